"""Credentials given in a run config's `storage_options` never reach what the run writes: real
4-step `llmtrain run` processes read their data from and checkpoint to a moto S3 server with an
access key id, a secret and a session token in `data.storage_options` and
`checkpoint.storage_options`. No file of the run (rank logs, config.yaml, metrics, the
TensorBoard event file, summary) and no object it wrote to the bucket holds any of them;
botocore's debug records stay out of the rank logs unless asked for, and asked for they come
redacted. The redacted config.yaml read back is refused in one line; without the redacted keys
and with the credentials in the environment, the run resumes."""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import train_support as ts
import yaml
from shared_fixtures import moto_endpoint  # noqa: F401

from llmtrain.core_mesh.logs import LIBRARY_LEVEL_ENV
from llmtrain.core_mesh.redact import MARKER

STEPS = 4
# the names under which the credentials live in the run's environment, when they do
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
THIRD_PARTY = ("botocore", "aiobotocore", "boto3", "s3fs", "s3transfer", "fsspec", "urllib3")


def _random(alphabet: str, n: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


@pytest.fixture(scope="module")
def credentials() -> SimpleNamespace:
    """Fresh values, so that finding one anywhere can only mean it leaked from this config."""
    upper = string.ascii_uppercase + string.digits
    b64 = string.ascii_letters + string.digits + "+/"
    return SimpleNamespace(
        key="AKIA" + _random(upper, 16), secret=_random(b64, 40), token=_random(b64, 160)
    )


@pytest.fixture(scope="module")
def s3(moto_endpoint, credentials, tmp_path_factory):  # noqa: F811
    """A bucket holding the packed training and eval data; the environment has no AWS
    credentials (the run config carries them), only the region."""
    from s3fs import S3FileSystem

    with pytest.MonkeyPatch.context() as env:
        for name in (*AWS_VARIABLES, "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
            env.delenv(name, raising=False)
        env.delenv(LIBRARY_LEVEL_ENV, raising=False)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        options = {
            "key": credentials.key,
            "secret": credentials.secret,
            "token": credentials.token,
            "endpoint_url": moto_endpoint,
        }
        S3FileSystem.clear_instance_cache()
        fs = S3FileSystem(**options)
        bucket = f"secrets-{_random(string.ascii_lowercase, 10)}"
        fs.mkdir(bucket)
        data = ts.pack_corpus(tmp_path_factory.mktemp("data"))
        for split in ("train", "valid"):
            fs.put(getattr(data, split), f"{bucket}/data/{split}.zarr", recursive=True)
        yield SimpleNamespace(fs=fs, bucket=bucket, options=options)
        S3FileSystem.clear_instance_cache()


def config(s3, runs: Path, name: str) -> dict:
    """The shared run config, shortened to 4 steps, with everything on S3."""
    data = SimpleNamespace(
        train=f"s3://{s3.bucket}/data/train.zarr", valid=f"s3://{s3.bucket}/data/valid.zarr"
    )
    config = ts.run_config(data, runs, name=name)
    config["training"].update(steps=STEPS, checkpoint_every=2)
    config["data"]["eval"].update(every=2, batches=1)
    config["data"]["storage_options"] = dict(s3.options)
    config["checkpoint"].update(dir=f"s3://{s3.bucket}/checkpoints/{name}")
    config["checkpoint"]["storage_options"] = dict(s3.options)
    config["loggers"] = [{"kind": "jsonl"}, {"kind": "tensorboard"}]
    return config


def leaked(credentials, blobs: dict[str, bytes]) -> list[str]:
    """`where: what` for each credential found in the named blobs."""
    found = []
    for where, blob in blobs.items():
        for what in ("key", "secret", "token"):
            if getattr(credentials, what).encode() in blob:
                found.append(f"{where}: {what}")
    return found


def run_files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def rank_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "rank0.jsonl").open()]


@pytest.fixture(scope="module")
def runs(s3, credentials, tmp_path_factory):
    """Two finished runs: one with the default logging, one with third-party debug records
    asked for through the environment."""
    tmp_path = tmp_path_factory.mktemp("runs")
    plain = ts.write_config(tmp_path / "plain.yaml", config(s3, tmp_path / "runs", "plain"))
    chatty = ts.write_config(tmp_path / "chatty.yaml", config(s3, tmp_path / "runs", "chatty"))
    ts.run(ts.llmtrain("run", plain), timeout=300)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(LIBRARY_LEVEL_ENV, "DEBUG")
        ts.run(ts.llmtrain("run", chatty), timeout=300)
    return SimpleNamespace(plain=tmp_path / "runs" / "plain", chatty=tmp_path / "runs" / "chatty")


def test_nothing_the_runs_wrote_holds_a_credential(runs, s3, credentials):
    for run_dir in (runs.plain, runs.chatty):
        assert ts.read_metrics(run_dir)[-1]["step"] == STEPS
        files = run_files(run_dir)
        assert any(name.startswith("tensorboard/") for name in files)
        assert leaked(credentials, files) == []
    objects = s3.fs.find(f"{s3.bucket}/checkpoints")
    assert any(o.endswith("COMMITTED") for o in objects)
    assert leaked(credentials, {o: s3.fs.cat(o) for o in objects}) == []


def test_third_party_debug_records_stay_out_of_the_log_by_default(runs):
    events = rank_log(runs.plain)
    assert any(e["event"] == "run.start" for e in events)
    assert any(e["event"] == "step" for e in events)  # our own debug records are kept
    third_party = [e for e in events if e["logger"].startswith(THIRD_PARTY)]
    assert [e for e in third_party if e["level"] in ("debug", "info")] == []


def test_asked_for_third_party_debug_records_come_redacted(runs):
    events = rank_log(runs.chatty)
    botocore = [e for e in events if e["logger"].startswith("botocore") and e["level"] == "debug"]
    assert botocore, "LLMTRAIN_LIBRARY_LOG_LEVEL=DEBUG kept no botocore debug record"
    signed = [e for e in botocore if "Authorization" in e["event"]]
    assert signed and all(f"'Authorization': b'{MARKER}'" in e["event"] for e in signed)


def test_config_yaml_and_tensorboard_hold_the_marker(runs):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    written = yaml.safe_load((runs.plain / "config.yaml").read_text())
    for section in ("data", "checkpoint"):
        options = written[section]["storage_options"]
        assert options["key"] == options["secret"] == options["token"] == MARKER
        assert options["endpoint_url"].startswith("http://127.0.0.1:")
    acc = ea.EventAccumulator(str(runs.plain / "tensorboard"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    markdown = tensor_util.make_ndarray(text.tensor_proto)[0].decode()
    shown = yaml.safe_load(markdown.removeprefix("```yaml\n").removesuffix("```\n"))
    assert shown == written


def test_the_redacted_config_is_refused_then_resumes_with_credentials_from_the_environment(
    runs, credentials, tmp_path
):
    config_file = runs.plain / "config.yaml"
    refused = ts.run(ts.llmtrain("run", config_file, "training.steps=6"), check=False)
    assert refused.returncode == 2, refused.stderr
    (error,) = ts.error_lines(refused.stderr)
    assert "data.storage_options.key" in error and "checkpoint.storage_options.token" in error
    assert "the credentials were redacted" in error and "AWS_SECRET_ACCESS_KEY" in error

    written = yaml.safe_load(config_file.read_text())
    for section in ("data", "checkpoint"):
        options = written[section]["storage_options"]
        written[section]["storage_options"] = {k: v for k, v in options.items() if v != MARKER}
    edited = ts.write_config(tmp_path / "resume.yaml", written)
    values = (credentials.key, credentials.secret, credentials.token)
    env = dict(zip(AWS_VARIABLES, values, strict=True))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        extend = ("training.steps=6", "training.on_extend=recompute")  # the lr is not tested
        resumed = ts.run(ts.llmtrain("run", edited, *extend), timeout=300)
    assert "run.resumed" in resumed.stderr
    assert sorted({m["step"] for m in ts.read_metrics(runs.plain)}) == list(range(1, 7))
    assert leaked(credentials, run_files(runs.plain)) == []
