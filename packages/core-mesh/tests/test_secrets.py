"""Credentials never reach a log or a dump: which keys look secret, `redact` on nested mappings,
`redact_text` on the forms credentials take in messages, refusing a redacted config read back,
and the logging set-up (third-party records from WARNING by default, every event redacted)."""

from __future__ import annotations

import io
import json
import logging

import attrs
import pytest
import structlog

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.logs import LIBRARY_LEVEL_ENV, configure_logging
from llmtrain.core_mesh.redact import (
    MARKER,
    is_secret_key,
    redact,
    redact_text,
    redacted_paths,
    refuse_redacted,
    secret_values,
)

KEY_ID = "AKIAZXCVBNMASDFGHJKL"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzzSECRETzz"
TOKEN = "FwoGZXIvYXdzEJr//////////wEaDSESSIONTOKENzz"


@pytest.mark.parametrize(
    "name",
    [
        "key",
        "secret",
        "token",
        "password",
        "credentials",
        "aws_access_key_id",
        "AWS_SECRET_ACCESS_KEY",
        "aws_session_token",
        "api_key",
        "apiKey",
        "Authorization",
        "Proxy-Authorization",
        "X-Amz-Security-Token",
        "X-Amz-Credential",
        "X-Amz-Signature",
        "SSECustomerKey",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "http_auth",
        "WANDB_API_KEY",
        "HF_TOKEN",
    ],
)
def test_secret_looking_keys(name):
    assert is_secret_key(name)


@pytest.mark.parametrize(
    "name",
    [
        "tokens",
        "global_batch_tokens",
        "flops_per_token",
        "eod_token",
        "max_new_tokens",
        "tokenizer",
        "loss_key",
        "missing_keys",
        "endpoint_url",
        "anon",
        "auth_type",
        "author",
        "region_name",
        "monkey",
        3,
    ],
)
def test_ordinary_keys(name):
    assert not is_secret_key(name)


def test_redact_masks_secret_values_at_any_depth_and_keeps_the_rest():
    config = {
        "name": "run",
        "training": {"steps": 4, "tokens": None},
        "data": {
            "train": [{"path": "s3://bucket/train.zarr", "weight": 1.0}],
            "storage_options": {
                "key": KEY_ID,
                "secret": SECRET,
                "token": TOKEN,
                "anon": False,
                "endpoint_url": "http://127.0.0.1:9000",
                "client_kwargs": {"region_name": "us-east-1", "aws_session_token": TOKEN},
            },
        },
        "callbacks": [{"kind": "x", "api_key": "abcdef123456"}],
        "init": {"from": "https://user:hunter2hunter2@host/weights", "storage_options": {}},
    }
    before = json.dumps(config)
    out = redact(config)
    assert json.dumps(config) == before  # a copy: the config the run uses keeps its credentials
    options = out["data"]["storage_options"]
    assert options == {
        "key": MARKER,
        "secret": MARKER,
        "token": MARKER,
        "anon": False,
        "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "us-east-1", "aws_session_token": MARKER},
    }
    assert out["callbacks"] == [{"kind": "x", "api_key": MARKER}]
    assert out["init"]["from"] == f"https://user:{MARKER}@host/weights"
    assert out["training"] == config["training"] and out["name"] == "run"
    assert out["data"]["train"] == config["data"]["train"]
    for value in (KEY_ID, SECRET, TOKEN, "abcdef123456", "hunter2hunter2"):
        assert value not in json.dumps(out)


def test_redact_keeps_empty_and_switch_values_that_reveal_nothing():
    options = {"token": None, "key": "", "secret": True, "password": False}
    assert redact(options) == options


def test_redact_masks_credentials_inside_strings_of_ordinary_keys():
    signed = (
        "https://b.s3.amazonaws.com/x.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={KEY_ID}%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
        f"&X-Amz-Security-Token={TOKEN}&X-Amz-Signature=0a1b2c3d"
    )
    out = redact({"path": signed, "note": f"made by {KEY_ID}", "hive": "data/key=abc/x.zarr"})
    assert KEY_ID not in out["path"] and TOKEN not in out["path"] and "0a1b2c3d" not in out["path"]
    assert out["path"].startswith("https://b.s3.amazonaws.com/x.jsonl?X-Amz-Algorithm=AWS4")
    assert out["note"] == f"made by {MARKER}"
    assert out["hive"] == "data/key=abc/x.zarr"  # a path is not a query: left as it is


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        # botocore's "Sending http request" line: the headers dict with bytes values
        (
            f"headers={{'X-Amz-Date': b'20240101T000000Z', 'X-Amz-Security-Token': b'{TOKEN}', "
            f"'Authorization': b'AWS4-HMAC-SHA256 Credential={KEY_ID}/20240101/us-east-1/s3/"
            "aws4_request, SignedHeaders=host;x-amz-date, Signature=abcdef0123'}",
            [TOKEN, KEY_ID, "abcdef0123"],
        ),
        # botocore's canonical request: one header a line
        (f"host:127.0.0.1\nx-amz-security-token:{TOKEN}\n\nhost;x-amz-date", [TOKEN]),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig", ["eyJhbGciOiJIUzI1NiJ9"]),
        (f"Credential={KEY_ID}/20240101/us-east-1/s3/aws4_request,", [KEY_ID]),
        (f"S3FileSystem(key='{KEY_ID}', secret='{SECRET}')", [KEY_ID, SECRET]),
        (f'{{"aws_secret_access_key": "{SECRET}", "region": "us-east-1"}}', [SECRET]),
        ("password=hunter2hunter2 user=alice", ["hunter2hunter2"]),
        (f"GET https://host/o?X-Amz-Security-Token={TOKEN}&partNumber=2", [TOKEN]),
        (f"key id {KEY_ID} is not valid", [KEY_ID]),
        ("ftp://alice:hunter2hunter2@files.example.com/data", ["hunter2hunter2"]),
    ],
)
def test_redact_text_masks_the_forms_credentials_take(text, gone):
    out = redact_text(text)
    assert MARKER in out
    for value in gone:
        assert value not in out, out


def test_redact_text_keeps_what_is_not_a_credential():
    text = (
        "step 4: tokens=8192 loss_key=loss missing key: model.n_layers "
        "'region_name': 'us-east-1' host:127.0.0.1 SignedHeaders=host;x-amz-date "
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert redact_text(text) == text


def test_redact_text_masks_known_values_in_any_form():
    assert redact_text("it was opaque-credential-xyz!", ["opaque-credential-xyz"]) == (
        f"it was {MARKER}!"
    )


def test_secret_values_are_long_values_of_secret_keys():
    found = secret_values(
        {"key": KEY_ID, "token": "short", "path": SECRET, "nested": {"secret": SECRET}}
    )
    assert found == {KEY_ID, SECRET}


def test_a_redacted_config_read_back_is_refused_in_one_line():
    raw = {"data": {"storage_options": {"key": MARKER, "secret": MARKER}}, "seed": 1}
    assert redacted_paths(raw) == ["data.storage_options.key", "data.storage_options.secret"]
    with pytest.raises(UserError) as info:
        refuse_redacted(raw, "runs/x/config.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "runs/x/config.yaml: data.storage_options.key, data.storage_options.secret: the "
        "credentials were redacted"
    )
    assert "AWS_ACCESS_KEY_ID" in message and "environment" in message
    clean = {"data": {"storage_options": {"anon": True}}, "loggers": [{"kind": "jsonl"}]}
    assert refuse_redacted(clean, "run.yaml") is clean
    assert redacted_paths({"a": [{"b": f"x{MARKER}"}]}) == ["a[0].b"]


# --- logging ---
def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def reset_logging():
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_llmtrain", False)]:
        root.removeHandler(handler)
        handler.close()
    structlog.reset_defaults()


def test_third_party_records_start_at_warning_by_default(tmp_path, monkeypatch, reset_logging):
    monkeypatch.delenv(LIBRARY_LEVEL_ENV, raising=False)
    console = io.StringIO()
    path = configure_logging(log_dir=tmp_path, console=console)
    structlog.get_logger("llmtrain.test").debug("ours.debug")
    logging.getLogger("llmtrain_plugin.x").debug("our plugin's debug")
    logging.getLogger("botocore.endpoint").debug("Sending http request")
    logging.getLogger("urllib3.connectionpool").info("Starting new HTTPS connection")
    logging.getLogger("s3fs").warning("s3fs warns")
    events = [e["event"] for e in _events(path)]
    assert events == ["ours.debug", "our plugin's debug", "s3fs warns"]
    assert "s3fs warns" in console.getvalue()


@pytest.mark.parametrize("library_level", ["WARNING", "DEBUG"])
def test_unclosed_session_notes_of_collected_filesystems_only_at_debug(
    tmp_path, monkeypatch, library_level, reset_logging
):
    """aiohttp's "Unclosed client session", logged by asyncio at ERROR when a collected s3fs
    filesystem's session was not closed in time, is no error of the run's."""
    monkeypatch.delenv(LIBRARY_LEVEL_ENV, raising=False)
    console = io.StringIO()
    path = configure_logging(log_dir=tmp_path, console=console, library_level=library_level)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.error("Unclosed client session\nclient_session: <aiohttp.ClientSession>")
    asyncio_log.error("Unclosed connector\nconnections: []")
    asyncio_log.error("Task exception was never retrieved")
    events = [e["event"].split("\n")[0] for e in _events(path)]
    if library_level == "DEBUG":
        assert events[:2] == ["Unclosed client session", "Unclosed connector"]
    else:
        assert "Unclosed" not in console.getvalue()
        assert events == ["Task exception was never retrieved"]


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_third_party_debug_when_asked_for_still_redacted(tmp_path, monkeypatch, how, reset_logging):
    monkeypatch.delenv(LIBRARY_LEVEL_ENV, raising=False)
    if how == "environment":
        monkeypatch.setenv(LIBRARY_LEVEL_ENV, "debug")
        path = configure_logging(log_dir=tmp_path, console=io.StringIO())
    else:
        path = configure_logging(log_dir=tmp_path, console=io.StringIO(), library_level="DEBUG")
    logging.getLogger("botocore.endpoint").debug(
        "Sending http request: %s", {"Authorization": f"AWS4 Credential={KEY_ID}/x"}
    )
    (event,) = _events(path)
    assert event["logger"] == "botocore.endpoint" and event["level"] == "debug"
    assert KEY_ID not in event["event"] and MARKER in event["event"]


def test_a_bad_library_level_in_the_environment_is_a_user_error(monkeypatch, reset_logging):
    monkeypatch.setenv(LIBRARY_LEVEL_ENV, "chatty")
    with pytest.raises(UserError, match=f"{LIBRARY_LEVEL_ENV}='chatty': unknown log level"):
        configure_logging(console=io.StringIO())


def test_every_event_is_redacted_on_the_console_and_in_the_file(
    tmp_path, monkeypatch, reset_logging
):
    monkeypatch.setenv("GITHUB_TOKEN", "env-secret-value-123")
    console = io.StringIO()
    path = configure_logging(
        log_dir=tmp_path, console=console, secrets=["opaque-run-credential"], level="DEBUG"
    )
    log = structlog.get_logger("llmtrain.test")
    log.info("open", storage_options={"key": KEY_ID, "secret": SECRET, "anon": False})
    log.info("said", message="the service answered with opaque-run-credential")
    log.info("env", message="header x-token env-secret-value-123")
    try:
        raise OSError(f"Forbidden for S3FileSystem(token='{TOKEN}')")
    except OSError:
        log.exception("failed")
    logging.getLogger("llmtrain_plugin").warning("upload with password=%s", "hunter2hunter2")
    text = path.read_text() + console.getvalue()
    for value in (KEY_ID, SECRET, TOKEN, "opaque-run-credential", "env-secret-value-123"):
        assert value not in text
    assert "hunter2hunter2" not in text
    events = _events(path)
    assert events[0]["storage_options"] == {"key": MARKER, "secret": MARKER, "anon": False}
    assert "OSError: Forbidden for S3FileSystem(token='<redacted>')" in events[3]["exception"]
    assert "anon" in console.getvalue() and "Traceback" in console.getvalue()


def test_objects_bytes_and_header_pairs_in_events_are_redacted(
    tmp_path, monkeypatch, reset_logging
):
    """Values that are not text reach the renderers as their str/repr: they are scrubbed too."""

    @attrs.define
    class Options:
        secret: str

    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_environment_token_1")
    console = io.StringIO()
    path = configure_logging(log_dir=tmp_path, console=console, level="DEBUG")
    log = structlog.get_logger("llmtrain.test")
    log.info("object", options=Options(SECRET))
    log.info("error", err=ValueError(f"secret='{SECRET}'"))
    log.info("bytes", body=f"aws_session_token={TOKEN}".encode())
    log.info("pair", header=("Authorization", f"Bearer {TOKEN}"))
    log.info("env", message="downloading with hf_environment_token_1")
    log.info("numbers", step=3, loss=1.5, none=None)
    text = path.read_text() + console.getvalue()
    for value in (SECRET, TOKEN, "hf_environment_token_1"):
        assert value not in text
    events = _events(path)
    assert events[3]["header"] == ["Authorization", MARKER]
    assert (events[5]["step"], events[5]["loss"], events[5]["none"]) == (3, 1.5, None)
