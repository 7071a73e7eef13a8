"""llmtrain.train_loop: the composition root: run config, Trainer, and the run-level CLI commands."""
