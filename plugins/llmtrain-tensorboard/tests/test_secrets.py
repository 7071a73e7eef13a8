"""The config text the `tensorboard` logger writes holds no credentials: TensorBoard's classic
`EventAccumulator` reads back the redaction marker where the run config had an access key, a
secret and a session token, and the event file holds none of them."""

from __future__ import annotations

import yaml
from llmtrain_tensorboard.plugin import TensorBoardOptions, TensorBoardSink

from llmtrain.core_mesh.interfaces import RunInfo
from llmtrain.core_mesh.redact import MARKER

KEY_ID = "AKIAZXCVBNMASDFGHJKL"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzzSECRETzz"
TOKEN = "FwoGZXIvYXdzEJr//////////wEaDSESSIONTOKENzz"
OPTIONS = {"key": KEY_ID, "secret": SECRET, "token": TOKEN, "endpoint_url": "http://127.0.0.1:9"}


def test_the_config_text_holds_the_marker_not_the_credentials(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    config = {
        "name": "unit",
        "data": {"train": [{"path": "s3://bucket/train.zarr"}], "storage_options": OPTIONS},
        "checkpoint": {"storage_options": {"aws_secret_access_key": SECRET}},
    }
    run = RunInfo(name="unit", run_dir=str(tmp_path), total_steps=2, start_step=0, config=config)
    sink = TensorBoardSink(TensorBoardOptions(), run)
    sink.log(1, {"loss": 2.0})
    sink.close()

    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    (event,) = acc.Tensors("config/text_summary")
    text = tensor_util.make_ndarray(event.tensor_proto)[0].decode()
    shown = yaml.safe_load(text.removeprefix("```yaml\n").removesuffix("```\n"))
    assert shown["data"]["storage_options"] == {
        "key": MARKER,
        "secret": MARKER,
        "token": MARKER,
        "endpoint_url": "http://127.0.0.1:9",
    }
    assert shown["checkpoint"]["storage_options"] == {"aws_secret_access_key": MARKER}
    assert shown["data"]["train"] == config["data"]["train"]
    assert config["data"]["storage_options"] == OPTIONS  # the run's own config is untouched
    (events_file,) = (tmp_path / "tensorboard").iterdir()
    blob = events_file.read_bytes()
    assert not any(value.encode() in blob for value in (KEY_ID, SECRET, TOKEN))
