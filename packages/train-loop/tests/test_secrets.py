"""A run's config.yaml never holds credentials, so what reads one back meets the redaction
marker instead: `llmtrain run` / `config validate` and `llmtrain which` refuse it in one line
before anything could send it as a credential, and a sweep (which writes its runs' configs and
runs them from there) refuses credentials in its base config. The real runs against S3 are in
integration_tests/test_secrets.py."""

from __future__ import annotations

import pytest
import yaml

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.redact import MARKER
from llmtrain.train_loop.experiments import which

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzzSECRETzz"


def write_config(tmp_path, *, data_options=None, checkpoint_options=None, name="base.yaml"):
    """A run config that plans and validates (its data is never read)."""
    config = {
        "name": "abl",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": {"kind": "tiny", "vocab_size": 320, "max_seq_len": 64},
        "data": {
            "train": [{"path": f"{tmp_path}/none.zarr"}],
            "seq_len": 64,
            "micro_batch": 8,
            "storage_options": data_options or {},
        },
        "optimizer": {"kind": "adamw", "lr": 3.0e-3},
        "training": {"steps": 10},
        "checkpoint": {"storage_options": checkpoint_options or {}},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_error(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.parametrize("command", [["config", "validate"], ["config", "show"], ["run"]])
def test_a_redacted_config_is_refused_in_one_line(tmp_path, run_cli, command):
    redacted = {"key": MARKER, "secret": MARKER, "endpoint_url": "http://127.0.0.1:9000"}
    path = write_config(tmp_path, data_options=redacted)
    code, out, err = run_cli(*command, path)
    assert code == 2 and out == ""
    assert one_error(err) == (
        f"error: {path}: data.storage_options.key, data.storage_options.secret: the credentials "
        "were redacted when this config was written; pass them through the environment "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE for S3) and "
        "delete these keys from the config"
    )
    assert not (tmp_path / "runs").exists()  # refused before the run began


def test_an_override_that_gives_the_value_again_is_accepted(tmp_path, run_cli):
    path = write_config(tmp_path, checkpoint_options={"secret": MARKER})
    code, _, err = run_cli(
        "config", "validate", path, f"checkpoint.storage_options.secret={SECRET}"
    )
    assert code == 0, err


def test_which_refuses_redacted_data_options_only(tmp_path):
    run_dir = tmp_path / "runs" / "abl"
    run_dir.mkdir(parents=True)
    # the checkpoint's credentials do not matter to which windows a step read
    source = write_config(tmp_path, checkpoint_options={"token": MARKER})
    (run_dir / "config.yaml").write_text(source.read_text())
    assert which.read_order(run_dir).data.seq_len == 64

    source = write_config(tmp_path, data_options={"token": MARKER})
    (run_dir / "config.yaml").write_text(source.read_text())
    with pytest.raises(UserError, match=r"data\.storage_options\.token: the credentials were red"):
        which.read_order(run_dir)


def test_a_sweep_refuses_credentials_in_its_runs_configs(tmp_path, run_cli):
    sweeps = tmp_path / "sweeps"
    path = write_config(tmp_path, data_options={"key": "AKIAZXCVBNMASDFGHJKL", "secret": SECRET})
    code, _, err = run_cli("sweep", path, "--grid", "seed=1,2", "--dir", sweeps)
    assert code == 2
    error = one_error(err)
    assert error.startswith(
        f"error: {path}: data.storage_options.key, data.storage_options.secret: a sweep cannot "
        "carry credentials"
    )
    assert SECRET not in err and "AWS_SECRET_ACCESS_KEY" in error
    assert not sweeps.exists()  # nothing written

    redacted = write_config(tmp_path, data_options={"secret": MARKER}, name="redacted.yaml")
    code, _, err = run_cli("sweep", redacted, "--grid", "seed=1,2", "--dir", sweeps)
    assert code == 2 and "the credentials were redacted" in one_error(err)


def test_a_sweep_without_credentials_writes_configs_as_before(tmp_path, run_cli):
    sweeps = tmp_path / "sweeps"
    options = {"anon": "true", "endpoint_url": "http://127.0.0.1:9000"}
    path = write_config(tmp_path, data_options=options)
    code, _, err = run_cli(
        "sweep", path, "--grid", "seed=1,2", "--launch", "print", "--dir", sweeps
    )
    assert code == 0, err
    written = yaml.safe_load((sweeps / "abl" / "seed=1" / "config.yaml").read_text())
    assert written["data"]["storage_options"] == options


def test_a_failed_run_s_summary_holds_no_credential(tmp_path):
    """The error a run failed with is written to summary.json with credentials masked: the
    run's own (known) secrets and any that look like one."""
    from types import SimpleNamespace

    from llmtrain.train_loop.builtin_callbacks import Summary

    secret = "run-secret-value-0123"
    description = SimpleNamespace(
        n_params=10, n_non_embedding_params=8, flops_per_token=lambda seq_len: 60.0 * seq_len
    )
    run = SimpleNamespace(
        world=SimpleNamespace(is_main=True, world_size=1),
        counters={"step": 2, "elapsed_s": 1.0},
        total_steps=10,
        global_batch=4,
        config=SimpleNamespace(data=SimpleNamespace(seq_len=8)),
        description=description,
        run_dir=tmp_path,
        secrets={secret},
        metric_directions={"loss": "lower"},
    )
    error = OSError(
        f"403 for https://bucket.s3/x?X-Amz-Credential=AKIAZXCVBNMASDFGHJKL and {secret}"
    )
    Summary().on_failure(run, error)
    text = (tmp_path / "summary.json").read_text()
    assert secret not in text and "AKIAZXCVBNMASDFGHJKL" not in text
    assert '"status": "failed"' in text and "OSError: 403 for" in text
