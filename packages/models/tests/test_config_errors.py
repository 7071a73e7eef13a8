"""TransformerConfig validation, the presets' published shapes, and presets as config `kind:`s."""

from __future__ import annotations

import attrs
import pytest
import torch

from llmtrain.core_mesh.config import (
    Choice,
    ConfigError,
    ConfigValueError,
    format_path,
    load_config,
    structure,
)
from llmtrain.core_mesh.conformance import protocol_mismatches
from llmtrain.core_mesh.interfaces import ModelOptions
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.models.config import TransformerConfig
from llmtrain.models.presets import PRESETS, preset_config
from llmtrain.models.transformer import Transformer, build_model


@attrs.frozen(kw_only=True)
class Schema:
    model: Choice.of("model")


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager(blocked=()).load_entry_points()


# -- TransformerConfig ---------------------------------------------------------------------------


def test_d_model_not_divisible_by_n_heads_names_n_heads():
    with pytest.raises(ConfigValueError) as info:
        TransformerConfig(d_model=65, n_heads=4)
    assert info.value.field == "n_heads"


def test_n_heads_not_divisible_by_n_kv_heads_names_n_kv_heads():
    with pytest.raises(ConfigValueError) as info:
        TransformerConfig(d_model=48, n_heads=6, n_kv_heads=4)
    assert info.value.field == "n_kv_heads"


def test_odd_head_dim_with_rope_names_d_model():
    with pytest.raises(ConfigValueError) as info:
        TransformerConfig(d_model=12, n_heads=4, positions="rope")
    assert info.value.field == "d_model"
    # the same shape is fine with learned positions: only rotary pairs need an even head_dim
    assert TransformerConfig(d_model=12, n_heads=4, positions="learned").head_dim == 3


def test_derived_properties():
    cfg = TransformerConfig(vocab_size=100, d_model=64, n_heads=4)
    assert cfg.padded_vocab_size == 128  # rounded up to a multiple of pad_vocab_to=64
    assert cfg.kv_heads == 4  # None means n_heads
    assert cfg.head_dim == 16
    assert cfg.hidden_size == 256  # gelu: 4 * d_model
    assert TransformerConfig(vocab_size=128, d_model=64, n_heads=4).padded_vocab_size == 128
    assert TransformerConfig(vocab_size=129, pad_vocab_to=1).padded_vocab_size == 129
    assert TransformerConfig(vocab_size=50257).padded_vocab_size == 50304
    assert TransformerConfig(n_heads=12, n_kv_heads=4).kv_heads == 4
    # swiglu: int(8 * d / 3) rounded up to a multiple of mlp_multiple_of
    swiglu = dict(d_model=64, n_heads=4, mlp="swiglu")
    assert TransformerConfig(**swiglu).hidden_size == 256  # int(170.67) = 170 -> 256
    assert TransformerConfig(**swiglu, mlp_multiple_of=32).hidden_size == 192  # 170 -> 192
    assert TransformerConfig(d_model=768, n_heads=12, mlp="swiglu").hidden_size == 2048
    assert TransformerConfig(**swiglu, mlp_hidden=100).hidden_size == 100


def test_sequence_longer_than_max_seq_len_raises_value_error():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=2)
    model = Transformer(cfg)
    assert model(torch.randint(0, 64, (1, 16))).shape == (1, 16, 64)  # exactly max is fine
    with pytest.raises(ValueError):
        model(torch.randint(0, 64, (1, 17)))


# -- presets --------------------------------------------------------------------------------------


def test_preset_names():
    assert {"tiny", "gpt2-124m", "gpt2-350m", "llama-1b", "llama-3b", "llama-8b"} <= set(PRESETS)


def test_tiny_preset_shape():
    cfg = preset_config("tiny")
    assert (cfg.max_seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads) == (
        256,
        64,
        2,
        4,
        2,
    )
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.bias) == ("rope", "rmsnorm", "swiglu", False)
    small = preset_config("tiny", vocab_size=64, max_seq_len=64)
    assert (small.vocab_size, small.max_seq_len, small.d_model) == (64, 64, 64)


def test_gpt2_124m_preset_has_124m_params():
    cfg = preset_config("gpt2-124m")
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.max_seq_len) == (50257, 50304, 1024)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads) == (768, 12, 12, 12)
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.bias) == ("learned", "layernorm", "gelu", True)
    assert cfg.tied_embeddings
    with torch.device("meta"):
        model = Transformer(cfg)
    n_params = model.describe().n_params
    # tok 50304*768 + pos 1024*768 + 12 blocks * 7,087,872 + final layernorm 2*768
    assert n_params == 124_475_904
    assert 123e6 < n_params < 125e6


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("llama-1b", (2048, 16, 32, 8, 8192)),
        ("llama-3b", (3072, 28, 24, 8, 8192)),
        ("llama-8b", (4096, 32, 32, 8, 14336)),
    ],
)
def test_llama_presets_shapes(name, shape):
    cfg = preset_config(name)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hidden_size) == shape
    assert cfg.rope_base == 500000.0
    assert cfg.vocab_size == 128256
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.bias) == ("rope", "rmsnorm", "swiglu", False)
    # built on meta only: never materialise billions of parameters in a unit test
    with torch.device("meta"):
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert len(model.blocks) == shape[1]
    assert model.tok_emb.weight.shape == (128256, shape[0])  # 128256 is a multiple of 64


def test_preset_overrides():
    cfg = preset_config("llama-1b", n_layers=2, max_seq_len=128)
    assert (cfg.d_model, cfg.n_layers, cfg.max_seq_len, cfg.n_kv_heads) == (2048, 2, 128, 8)
    with pytest.raises(ConfigValueError):
        preset_config("tiny", d_model=65)


# -- presets as model kinds through the plugin manager -------------------------------------------


def test_presets_are_model_kinds(plugins):
    names = set(plugins.registry("model").names())
    assert {"transformer", "tiny", "gpt2-124m", "llama-1b", "llama-3b", "llama-8b"} <= names


def test_llama_kind_with_override_structures(plugins):
    cfg = structure({"model": {"kind": "llama-1b", "n_layers": 2}}, Schema, plugins=plugins)
    assert cfg.model.kind == "llama-1b"
    assert cfg.model.options.d_model == 2048
    assert cfg.model.options.n_layers == 2
    assert cfg.model.options.n_kv_heads == 8
    assert cfg.model.options.rope_base == 500000.0


def test_transformer_kind_is_the_plain_defaults(plugins):
    cfg = structure({"model": {"kind": "transformer"}}, Schema, plugins=plugins)
    assert (cfg.model.options.d_model, cfg.model.options.n_layers) == (768, 12)


def test_the_options_are_what_the_trainer_reads(plugins):
    """core-mesh's ModelOptions: vocab_size, max_seq_len, doc_masking and training_only."""
    assert protocol_mismatches(TransformerConfig, ModelOptions) == []
    options = plugins.options_of("model", Choice.of("model")("tiny"))
    assert isinstance(options, ModelOptions) and options == preset_config("tiny")
    assert TransformerConfig.training_only <= {a.name for a in attrs.fields(TransformerConfig)}


def test_bad_shape_under_a_kind_is_reported_at_its_path(plugins):
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", "d_model": 65}}, Schema, plugins=plugins)
    assert [p.path for p in info.value.problems] == [("model", "n_heads")]


def test_unknown_key_is_reported_at_its_path(plugins):
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", "n_layer": 4}}, Schema, plugins=plugins)
    paths = [p.path for p in info.value.problems]
    assert paths == [("model", "n_layer")]
    assert "n_layers" in str(info.value)  # a did-you-mean hint


def test_wrong_type_is_reported_at_its_path(plugins):
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", "n_layers": "4"}}, Schema, plugins=plugins)
    assert [p.path for p in info.value.problems] == [("model", "n_layers")]


def test_bad_choice_value_is_reported_at_its_path(plugins):
    raw = {"model": {"kind": "tiny", "positions": "alibi", "qk_norm": "false"}}
    with pytest.raises(ConfigError) as info:
        structure(raw, Schema, plugins=plugins)
    assert sorted(p.path for p in info.value.problems) == [
        ("model", "positions"),
        ("model", "qk_norm"),
    ]


@pytest.mark.parametrize(
    ("field", "value"), [("positions", "alibi"), ("norm", "batchnorm"), ("mlp", "relu")]
)
def test_choice_fields_rejected_in_python_too(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{field: value})


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("init_std", -1.0, "must be a positive number, got -1.0"),
        ("init_std", 0.0, "must be a positive number, got 0.0"),
        ("norm_eps", 0.0, "must be a positive number, got 0.0"),
        ("norm_eps", -1e-5, "must be a positive number, got -1e-05"),
        ("rope_base", 0.0, "must be a number above 1, got 0.0"),
        ("rope_base", 1.0, "must be a number above 1, got 1.0"),
    ],
)
def test_numbers_that_cannot_train_are_refused_at_their_path(plugins, key, value, says):
    """A negative init std used to end in a raw RuntimeError, a zero norm eps trained on, and a
    RoPE base of 0 surfaced only as a NaN loss."""
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", key: value}}, Schema, plugins=plugins)
    assert [p.path for p in info.value.problems] == [("model", key)]
    assert says in str(info.value)


# -- attention options and Gemma's: refused in one line that names the field ---------------------

WINDOWED = {"window": 16}
# name: (the model's options over `kind: tiny` (2 layers, max_seq_len 256), the field, words)
ATTENTION_ERRORS = {
    "pattern-entry": ({"attention": {**WINDOWED, "pattern": ["local", "sliding"]}}, "attention.pattern", "list of local and global"),
    "pattern-empty": ({"attention": {**WINDOWED, "pattern": []}}, "attention.pattern", "list of local and global"),
    "pattern-longer-than-n_layers": ({"attention": {**WINDOWED, "pattern": ["local", "global", "local"]}}, "attention.pattern", "3 entries for 2 layers"),
    "window-is-max_seq_len": ({"attention": {"window": 256}}, "attention.window", "covers the whole context"),
    "window-past-max_seq_len": ({"attention": {"window": 1000}}, "attention.window", "covers the whole context"),
    "window-0": ({"attention": {"window": 0}}, "attention.window", "at least 1"),
    "local_rope_base-without-window": ({"attention": {"local_rope_base": 10000.0}}, "attention.local_rope_base", "needs positions: rope and attention.window"),
    "local_rope_base-without-rope": ({"positions": "learned", "attention": {**WINDOWED, "local_rope_base": 10000.0}}, "attention.local_rope_base", "needs positions: rope and attention.window"),
    "local_rope_base-1": ({"attention": {**WINDOWED, "local_rope_base": 1.0}}, "attention.local_rope_base", "above 1"),
    "scale-with-mup": ({"parametrization": "mup", "attention": {"scale": 0.125}}, "attention.scale", "µP sets the attention scale"),
    "scale-0": ({"attention": {"scale": 0.0}}, "attention.scale", "positive number"),
    "softcap-0": ({"attention": {"softcap": 0.0}}, "attention.softcap", "positive number"),
    "softcap-negative": ({"attention": {"softcap": -50.0}}, "attention.softcap", "positive number"),
    "logit_softcap-0": ({"logit_softcap": 0.0}, "logit_softcap", "positive number"),
    "logit_softcap-negative": ({"logit_softcap": -30.0}, "logit_softcap", "positive number"),
    "llama3-without-original": ({"rope_scaling": {"factor": 8.0}}, "rope_scaling.original_max_seq_len", "kind llama3 needs the context"),
    "rope_scaling-kind": ({"rope_scaling": {"kind": "yarn", "factor": 8.0}}, "rope_scaling.kind", "llama3"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("options", "field", "words"), ATTENTION_ERRORS.values(), ids=ATTENTION_ERRORS.keys()
)
def test_attention_options_that_cannot_run_are_one_line_naming_the_field(
    plugins, options, field, words
):
    with pytest.raises(ConfigError) as info:
        structure({"model": {"kind": "tiny", **options}}, Schema, plugins=plugins)
    assert [format_path(p.path) for p in info.value.problems] == [f"model.{field}"]
    message = str(info.value)
    assert message.startswith(f"model.{field}: ") and "\n" not in message
    assert words in message


def test_the_attention_options_that_run(plugins):
    """What the refusals leave: a window below max_seq_len, a pattern as long as the model,
    the local base with a window and RoPE, linear scaling without an original length."""
    raw = {
        "kind": "tiny",
        "attention": {"window": 255, "pattern": ["global", "local"], "local_rope_base": 1e4},
        "rope_scaling": {"kind": "linear", "factor": 8.0},
        "logit_softcap": 30.0,
    }
    options = structure({"model": raw}, Schema, plugins=plugins).model.options
    assert options.attention.window_of(0) is None and options.attention.window_of(1) == 255
    assert options.rope_scaling.kind == "linear" and options.rope_scaling.factor == 8.0
    assert options.rope_scaling.original_max_seq_len is None


# the options whose check spans fields (TransformerConfig's own): where they sit in a file
LOCATED = {
    "pattern-longer-than-n_layers": ("  attention:\n    window: 16\n    pattern: [local, global, local]\n", ("attention", "pattern"), 6),
    "window-is-max_seq_len": ("  attention:\n    window: 256\n", ("attention", "window"), 5),
    "local_rope_base-without-window": ("  attention:\n    local_rope_base: 10000.0\n", ("attention", "local_rope_base"), 5),
    "scale-with-mup": ("  parametrization: mup\n  attention:\n    scale: 0.125\n", ("attention", "scale"), 6),
    "softcap-0": ("  attention:\n    softcap: 0.0\n", ("attention", "softcap"), 5),
}  # fmt: skip


@pytest.mark.parametrize(("yaml", "path", "line"), LOCATED.values(), ids=LOCATED.keys())
def test_an_attention_refusal_points_at_its_line(plugins, tmp_path, yaml, path, line):
    """Through the YAML loader, the problem's path is the key's (model, attention, <field>)
    and its `file:line` the line of that key, as for every other option."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  kind: tiny\n  n_layers: 2\n" + yaml)
    with pytest.raises(ConfigError) as info:
        load_config(config, Schema, plugins=plugins)
    [problem] = info.value.problems
    assert (problem.where, problem.path) == (f"{config}:{line}", ("model", *path))
    assert str(info.value).startswith(f"{config}:{line}: model.{'.'.join(path)}: ")
