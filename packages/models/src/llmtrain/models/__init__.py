"""llmtrain.models: the decoder-only transformer family, described through core-mesh interfaces."""
