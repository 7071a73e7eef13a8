"""A test model plugin that is not a transformer (see the distribution's README)."""
