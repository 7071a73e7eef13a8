"""llmtrain.ablate: read finished (or running) runs and sweeps back: compare, plot, profiles, ranks.

This package never imports torch, so a sweep directory copied to a laptop can be read there.
"""
