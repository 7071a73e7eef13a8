"""Shared test setup for the models package: one torch thread for the session."""

from __future__ import annotations

from shared_fixtures import one_torch_thread  # noqa: F401
