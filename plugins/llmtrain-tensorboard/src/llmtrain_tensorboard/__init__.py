"""llmtrain-tensorboard: the `tensorboard` logger plugin for llmtrain (see `plugin`)."""
