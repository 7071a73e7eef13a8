"""llmtrain-wandb: the `wandb` logger plugin for llmtrain (see `plugin`)."""
