"""llmtrain.parallel: DDP, FSDP2, HSDP, TP, PP and CP for any model that describes itself through
`llmtrain.core_mesh.interfaces.ModelDescription`."""
