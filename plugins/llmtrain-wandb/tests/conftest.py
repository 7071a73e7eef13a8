"""`run_cli` (an in-process `llmtrain ...`) from the repo's shared fixtures, and wandb kept in
a temporary home for every test module."""

from __future__ import annotations

import os

import pytest
from shared_fixtures import run_cli  # noqa: F401


@pytest.fixture(scope="module", autouse=True)
def hermetic_wandb(tmp_path_factory):
    """wandb's files, settings and credentials in a temporary home; no network reporting."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("WANDB_")]:
            mp.delenv(name)
        for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
            (home / name.lower()).mkdir()
            mp.setenv(f"WANDB_{name}", str(home / name.lower()))
        mp.setenv("HOME", str(home))  # no ~/.netrc credentials
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        mp.setenv("WANDB_DISABLE_GIT", "true")  # the tests run inside the llmtrain repo
        mp.setenv("WANDB_DISABLE_CODE", "true")
        yield home
