"""The config the `wandb` logger gives W&B holds no credentials: a real offline W&B run, read back
from its `.wandb` transaction log with wandb's own reader, has the redaction marker where the
run config had an access key, a secret and a session token; no file wandb wrote holds them."""

from __future__ import annotations

import json
import subprocess
import sys

from llmtrain.core_mesh.redact import MARKER

KEY_ID = "AKIAZXCVBNMASDFGHJKL"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzzSECRETzz"
TOKEN = "FwoGZXIvYXdzEJr//////////wEaDSESSIONTOKENzz"
CONFIG = {
    "name": "r",
    "data": {
        "train": [{"path": "s3://bucket/train.zarr", "weight": 1.0}],
        "storage_options": {"key": KEY_ID, "secret": SECRET, "token": TOKEN, "anon": "false"},
    },
    "checkpoint": {"dir": "s3://bucket/ckpt", "storage_options": {"aws_session_token": TOKEN}},
}


def records(path) -> list[dict]:
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_the_wandb_config_holds_the_marker_not_the_credentials(tmp_path):
    run_dir = tmp_path / "run"
    probe = (
        "from llmtrain.core_mesh.interfaces import RunInfo\n"
        "from llmtrain_wandb.plugin import WandbOptions, WandbSink\n"
        f"run = RunInfo(name='r', run_dir={str(run_dir)!r}, total_steps=1, start_step=0,\n"
        f"              config={CONFIG!r})\n"
        "sink = WandbSink(WandbOptions(mode='offline', project='p'), run)\n"
        "sink.log(1, {'loss': 1.0})\n"
        "sink.close()\n"
    )
    subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=600, check=True)

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (run,) = [r["run"] for r in records(log) if r["type"] == "run"]
    logged = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert logged["data"]["storage_options"] == {
        "key": MARKER,
        "secret": MARKER,
        "token": MARKER,
        "anon": "false",
    }
    assert logged["checkpoint"] == {
        "dir": "s3://bucket/ckpt",
        "storage_options": {"aws_session_token": MARKER},
    }
    assert logged["data"]["train"] == CONFIG["data"]["train"]
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert written
    for path in written:
        blob = path.read_bytes()
        assert not any(value.encode() in blob for value in (KEY_ID, SECRET, TOKEN)), path
