"""`llmtrain run` as a user meets it: what a missing argument says, global flags after the
config, and a config error under torchrun printed once (not by every rank)."""

from __future__ import annotations

import os
import subprocess
import sys

BAD_CONFIG = """\
name: bad
device: cpu
modle: {kind: tiny}
"""
MESSAGE = "modle: unknown key (did you mean 'model'?)"


def test_run_without_arguments_says_the_config_is_missing(run_cli, capsys):
    code, _, err = run_cli("run")
    assert code == 2
    assert err.splitlines() == [
        "error: llmtrain run: the following arguments are required: CONFIG; see llmtrain run --help"
    ]


def test_global_flags_may_follow_the_config(tmp_path, run_cli):
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_CONFIG)
    code, _, err = run_cli("run", config, "training.steps=3", "--debug")
    assert code == 2
    assert MESSAGE in err
    assert "Traceback (most recent call last)" in err  # --debug took effect


def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    """Two real ranks meet the same error: rank 0 prints it, rank 1 says nothing."""
    (tmp_path / "bad.yaml").write_text(BAD_CONFIG)
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*torchrun, "-m", "llmtrain", "run", "bad.yaml"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stderr
    assert proc.stderr.count(MESSAGE) == 1, proc.stderr
    assert proc.stderr.count("error: bad.yaml: ") == 1, proc.stderr
    # rank 0 ended the launch with the user error's exit code
    assert "exitcode  : 2" in proc.stderr, proc.stderr
