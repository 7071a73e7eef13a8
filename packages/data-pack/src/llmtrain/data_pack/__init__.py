"""llmtrain.data_pack: tokenize corpora into zarr token stores and read them back as training windows.

This package never imports torch, so a CPU preprocessing machine can install it alone.
"""
