"""Shared test setup for ablate's unit tests: `run_cli` runs `llmtrain ...` in this process."""

from __future__ import annotations

from shared_fixtures import run_cli  # noqa: F401
