"""llmtrain.train_loop.experiments: commands that plan, launch and read back many runs; nothing
here runs inside the training loop."""
