"""llmtrain-moe: a Mixture-of-Experts decoder as an llmtrain model plugin (kinds `moe-tiny`, `moe-small`)."""
