"""llmtrain.checkpoint: distributed checkpoints (torch DCP) through fsspec, committed atomically."""
