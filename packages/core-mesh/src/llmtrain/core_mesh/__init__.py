"""llmtrain.core_mesh: interfaces, plugins, strict config, logging, world and device mesh.

Installs and imports without torch; only the functions that start a process group or build a
DeviceMesh import it.
"""
