"""`DatasetError`: a packed dataset that is missing, incomplete, damaged or does not fit the run.

A module of its own so that the format (`store.py`) and the integrity checks (`integrity.py`, whose
`DamagedDatasetError` is one) both import it without importing each other.
"""

from __future__ import annotations

from llmtrain.core_mesh.errors import UserError


class DatasetError(UserError):
    """A packed dataset that is missing, incomplete, or does not fit the run."""
