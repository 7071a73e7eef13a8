"""`run_cli` (an in-process `llmtrain ...`) from the repo's shared fixtures."""

from __future__ import annotations

from shared_fixtures import run_cli  # noqa: F401
