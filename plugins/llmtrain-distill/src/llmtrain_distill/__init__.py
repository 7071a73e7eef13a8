"""llmtrain-distill: the `distill` objective plugin for llmtrain (see `plugin`)."""
