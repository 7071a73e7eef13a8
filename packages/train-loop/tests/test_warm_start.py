"""Warm start's decisions without a run: which source `init:` names (a format registered in
process through the `weights` hook), which model options must match, and the tokenizer check.
The runs themselves are in integration_tests/test_warm_start.py and llmtrain-hf's tests."""

from __future__ import annotations

import pytest
import torch

from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import ModelState
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import WeightFormat
from llmtrain.core_mesh.plugins import PluginManager, hookimpl
from llmtrain.train_loop import warm_start
from llmtrain.train_loop.model_source import load_run_config, with_model_source
from llmtrain.train_loop.run_config import InitConfig
from llmtrain.train_loop.saved_model import model_info

TINY = {"kind": "tiny", "vocab_size": 300, "pad_vocab_to": 64, "d_model": 32}


class MarkerFormat:
    """A directory with a WEIGHTS file: a stand-in weight format."""

    def describe(self) -> str:
        return "a WEIGHTS file"

    def recognizes(self, path, storage_options) -> bool:
        import os

        return os.path.exists(os.path.join(path, "WEIGHTS"))

    def load(self, path, storage_options):
        raise AssertionError("not loaded by these tests")

    def model(self, path, storage_options):
        return dict(TINY)


class MarkerPlugin:
    @hookimpl
    def llmtrain_weight_formats(self, register):
        register("marker", lambda options: MarkerFormat(), help="test format")


@pytest.fixture
def plugins() -> PluginManager:
    """The installed plugins without llmtrain-hf (as in the package's own nox session)."""
    return PluginManager(blocked={"hf"}).load_entry_points()


def test_a_weight_format_plugin_satisfies_the_protocol():
    assert isinstance(MarkerFormat(), WeightFormat)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_auto_tells_llmtrain_checkpoints_from_registered_formats(plugins, tmp_path):
    with pytest.raises(warm_start.WarmStartError) as info:
        warm_start.resolve(InitConfig(from_=str(tmp_path)), plugins)
    message = str(info.value)
    assert f"init.from: {tmp_path} is in no format this installation reads" in message
    assert "installed formats: llmtrain (built in)" in message
    assert "a Hugging Face directory needs `pip install llmtrain-hf`" in message

    plugins.register(MarkerPlugin(), "marker")
    (tmp_path / "WEIGHTS").write_text("")
    assert warm_start.resolve(InitConfig(from_=str(tmp_path)), plugins) == (
        "marker",
        str(tmp_path),
        None,
    )
    with pytest.raises(warm_start.WarmStartError, match=r"init\.step: 3 is for llmtrain"):
        warm_start.resolve(InitConfig(from_=str(tmp_path), step=3), plugins)
    with pytest.raises(warm_start.WarmStartError, match="holds no committed llmtrain checkpoint"):
        warm_start.resolve(InitConfig(from_=str(tmp_path), format="llmtrain"), plugins)

    # a committed checkpoint wins over anything else in the directory; a step-<n>/ names a step
    model = torch.nn.Linear(2, 2)
    for step in (4, 8):
        Checkpointer(str(tmp_path)).save(step, {"train": ModelState(model)})
    assert warm_start.resolve(InitConfig(from_=f"{tmp_path}/"), plugins) == (
        "llmtrain",
        str(tmp_path),
        8,
    )
    assert warm_start.resolve(InitConfig(from_=str(tmp_path / "step-4")), plugins)[1:] == (
        str(tmp_path),
        4,
    )
    with pytest.raises(warm_start.WarmStartError) as info:
        warm_start.resolve(InitConfig(from_=str(tmp_path), step=5), plugins)
    assert "init.step:" in str(info.value) and "committed steps in" in str(info.value)
    assert "4, 8" in str(info.value)
    # a format named explicitly is asked even beside checkpoints, and must recognise the path
    assert warm_start.resolve(InitConfig(from_=str(tmp_path), format="marker"), plugins)[0] == (
        "marker"
    )
    (tmp_path / "WEIGHTS").unlink()
    with pytest.raises(warm_start.WarmStartError) as info:
        warm_start.resolve(InitConfig(from_=str(tmp_path), format="marker"), plugins)
    assert (
        str(info.value)
        == f"init.from: {tmp_path} is not in format 'marker' (it needs a WEIGHTS file)"
    )


def info_of(plugins, **options) -> dict:
    from llmtrain.core_mesh.config import Choice, structure

    return model_info(plugins, structure({**TINY, **options}, Choice.of("model"), plugins=plugins))


@pytest.mark.parametrize(
    ("source", "run"),
    [
        ({}, {"dropout": 0.1, "doc_masking": True, "init_std": 0.01}),  # training only
        ({}, {"vocab_size": 310}),  # the same 320 embedding rows
        ({"max_seq_len": 128}, {"max_seq_len": 512}),  # RoPE: no position weights
        ({}, {"kind": "transformer", **{k: v for k, v in TINY.items() if k != "kind"}}),
    ],
    ids=["training-only", "same-padded-vocab", "rope-length", "same-family"],
)
def test_options_that_may_differ(plugins, source, run):
    from llmtrain.models.presets import PRESETS

    theirs = info_of(plugins, **source)
    if run.get("kind") == "transformer":  # the tiny preset spelled out under another kind
        run = {**PRESETS["tiny"], **run}
    ours = info_of(plugins, **run)
    assert warm_start.model_differences(theirs, ours, plugins) == []


def test_options_that_must_match_are_named_with_both_values(plugins):
    theirs = info_of(plugins, positions="learned", norm_eps=1e-6, max_seq_len=128)
    ours = info_of(plugins, positions="learned", max_seq_len=256, vocab_size=400, dropout=0.2)
    assert warm_start.model_differences(theirs, ours, plugins) == [
        "model.max_seq_len: 128 in init.from, 256 here",
        "model.norm_eps: 1e-06 in init.from, 1e-05 here",
        "model.vocab_size: embedding rows 320 in init.from (vocab_size: 300, pad_vocab_to: 64), "
        "448 here (vocab_size: 400, pad_vocab_to: 64)",
    ]
    other = {"kind": "gpt-from-elsewhere", "d_model": 32}
    assert warm_start.model_differences(other, theirs, plugins) == [
        "model.kind: 'gpt-from-elsewhere' in init.from, 'tiny' here (another model family)"
    ]


def test_tensor_differences_name_both_shapes_and_count_the_rest():
    source = {f"w{i}": (2, 2) for i in range(8)}
    expected = {**{f"w{i}": (2, 3) for i in range(6)}, "extra": (1,)}
    assert warm_start.tensor_differences(source, expected) == [
        "tensor w0: (2, 2) in init.from, (2, 3) here",
        "tensor w1: (2, 2) in init.from, (2, 3) here",
        "tensor w2: (2, 2) in init.from, (2, 3) here",
        "tensor w3: (2, 2) in init.from, (2, 3) here",
        "(and 5 more tensors)",  # w4, w5, extra: missing in init.from, w6, w7: not in this model
    ]
    assert warm_start.tensor_differences(source, source) == []


def test_another_tokenizer_names_both_and_the_way_out():
    own = {"fingerprint": "b" * 8, "tokenizer": {"name": "hf:tokenizer.json"}}
    warm_start.check_tokenizer("ckpt", {}, own)  # the source does not say: nothing to check
    warm_start.check_tokenizer("ckpt", {"fingerprint": "b" * 8}, own)
    with pytest.raises(warm_start.WarmStartError) as info:
        warm_start.check_tokenizer(
            "ckpt", {"fingerprint": "a" * 8, "tokenizer": {"name": "bytes"}}, own
        )
    message = str(info.value)
    assert message.startswith("init.from: ckpt was trained on data tokenized by bytes (aaaaaaaa)")
    assert "packed with hf:tokenizer.json (bbbbbbbb)" in message
    assert "init.check_tokenizer: false" in message


# --- model: {from: ...} ---------------------------------------------------------------------------


def test_the_model_section_comes_from_a_checkpoint_or_a_weight_format(plugins, tmp_path):
    plugins.register(MarkerPlugin(), "marker")
    source = str(tmp_path / "ckpt")
    checkpoints = Checkpointer(source)
    for step, layers in ((2, 3), (4, 5)):
        recorded = {**TINY, "n_layers": layers}
        checkpoints.save(
            step, {"train": ModelState(torch.nn.Linear(2, 2))}, info={"model": recorded}
        )
    at_step_4 = {**TINY, "n_layers": 5}

    # the newest step's options, with the section's other keys on top
    raw = {"name": "x", "model": {"from": source, "dropout": 0.1}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == {**at_step_4, "dropout": 0.1}
    # init.from alone gives the model; init.step picks the step whose options are read
    raw = {"name": "x", "init": {"from": source}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == at_step_4
    raw = {"name": "x", "model": {"doc_masking": True}, "init": {"from": source}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == {
        **at_step_4,
        "doc_masking": True,
    }
    raw = {"name": "x", "model": {"from": source}, "init": {"from": source, "step": 2}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == {**TINY, "n_layers": 3}
    # a model section of its own stays as written
    raw = {"name": "x", "model": {"kind": "tiny"}, "init": {"from": source}}
    assert with_model_source(raw, plugins, "run.yaml") is raw
    # a weight format says its model without reading the weights
    marker = tmp_path / "marker"
    marker.mkdir()
    (marker / "WEIGHTS").write_text("")
    raw = {"model": {"from": str(marker), "n_layers": 1}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == {**TINY, "n_layers": 1}


def test_a_model_source_that_cannot_be_read_is_refused_naming_the_file(plugins, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError) as info:
        with_model_source({"model": {"from": str(missing)}}, plugins, "run.yaml")
    assert str(info.value) == f"run.yaml: model.from: {missing} does not exist"
    with pytest.raises(UserError) as info:
        with_model_source({"model": {"from": 3}}, plugins, "run.yaml")
    assert str(info.value) == "run.yaml: model.from: expected a path or URL, got 3"
    Checkpointer(str(tmp_path / "bare")).save(1, {"train": ModelState(torch.nn.Linear(2, 2))})
    with pytest.raises(UserError, match=r"run\.yaml: model\.from: .* does not record its model"):
        with_model_source({"model": {"from": str(tmp_path / "bare")}}, plugins, "run.yaml")


def test_a_run_config_file_reads_its_model_from_the_source(plugins, tmp_path):
    source = str(tmp_path / "ckpt")
    recorded = {**TINY, "n_layers": 3, "qkv_bias": True}
    Checkpointer(source).save(
        1, {"train": ModelState(torch.nn.Linear(2, 2))}, info={"model": recorded}
    )
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: ft\nmodel: {{from: {source}}}\ninit: {{from: {source}}}\n"
        "data: {train: [{path: d.zarr}], seq_len: 16, micro_batch: 2}\n"
        "optimizer: {kind: adamw}\ntraining: {steps: 1}\n"
    )
    run = load_run_config(str(config), plugins, ["model.doc_masking=true"])
    options = run.model.options
    assert run.model.kind == "tiny"
    assert (options.n_layers, options.d_model, options.qkv_bias, options.out_bias) == (
        3,
        32,
        True,
        False,
    )
    assert options.doc_masking  # an override on top of the source's options


def test_a_resumed_run_takes_the_model_its_own_checkpoint_recorded(plugins, tmp_path):
    """The source is not read again: it may have moved since the run started."""
    gone = str(tmp_path / "moved-away")
    own = tmp_path / "runs" / "ft" / "checkpoints"
    recorded = {**TINY, "n_layers": 3}
    Checkpointer(str(own)).save(
        5, {"train": ModelState(torch.nn.Linear(2, 2))}, info={"model": recorded}
    )
    raw = {"name": "ft", "run_dir": str(tmp_path / "runs"), "model": {"from": gone, "dropout": 0.1}}
    assert with_model_source(raw, plugins, "run.yaml")["model"] == {**recorded, "dropout": 0.1}
    # a run that will not resume reads the source
    never = {**raw, "checkpoint": {"resume": "never"}}
    with pytest.raises(UserError, match=r"model\.from: .*moved-away does not exist"):
        with_model_source(never, plugins, "run.yaml")


def test_init_settings_apply_to_the_same_source_written_another_way(plugins, tmp_path):
    source = str(tmp_path / "ckpt")
    for step, layers in ((2, 3), (4, 5)):
        Checkpointer(source).save(
            step,
            {"train": ModelState(torch.nn.Linear(2, 2))},
            info={"model": {**TINY, "n_layers": layers}},
        )
    raw = {"model": {"from": source}, "init": {"from": source + "/", "step": 2}}
    assert with_model_source(raw, plugins, "run.yaml")["model"]["n_layers"] == 3


def test_options_that_compute_nothing_here_do_not_count_as_differences(plugins):
    # Qwen2 as imported (bias false, q/k/v biases) and the same model written with bias true
    imported = info_of(plugins, bias=False, qkv_bias=True)
    written = info_of(plugins, bias=True, out_bias=False, mlp_bias=False)
    assert warm_start.model_differences(imported, written, plugins) == []
    # a q/k norm scope without a q/k norm
    assert (
        warm_start.model_differences(
            info_of(plugins, qk_norm_scope="all_heads"), info_of(plugins), plugins
        )
        == []
    )
    # but the biases themselves, and the scope of a q/k norm, are compared
    assert warm_start.model_differences(imported, info_of(plugins, bias=False), plugins) == [
        "model.qkv_bias: q/k/v biases True in init.from (qkv_bias: True), False here "
        "(qkv_bias: False)"
    ]
    scoped = info_of(plugins, qk_norm=True, qk_norm_scope="all_heads")
    assert warm_start.model_differences(scoped, info_of(plugins, qk_norm=True), plugins) == [
        "model.qk_norm_scope: 'all_heads' in init.from, 'head' here"
    ]
