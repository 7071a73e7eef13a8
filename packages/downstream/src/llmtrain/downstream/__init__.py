"""Downstream evaluation: tasks read from their published file layouts, scored by
log-likelihood on a model at any parallel layout."""
