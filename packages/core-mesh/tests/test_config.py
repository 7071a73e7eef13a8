"""Strict config: every problem reported at once, with its path and line; overrides; round trip."""

from __future__ import annotations

from typing import Literal

import attrs
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtrain.core_mesh.config import (
    YAML_KEY,
    Choice,
    ConfigError,
    ConfigValueError,
    apply_overrides,
    dump_config,
    load_config,
    make_converter,
    parse_yaml,
    structure,
)
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.mesh import MeshSpec
from llmtrain.core_mesh.plugins import PluginManager, hookimpl


def _positive(instance, attribute, value):
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class GptOptions:
    n_layers: int = attrs.field(default=2, validator=_positive)
    n_heads: int = 4
    d_model: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __attrs_post_init__(self):
        if self.d_model % self.n_heads:
            raise ConfigValueError(
                "n_heads", f"must divide d_model={self.d_model}, got {self.n_heads}"
            )


@attrs.frozen(kw_only=True)
class AdamOptions:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


@attrs.frozen(kw_only=True)
class Training:
    steps: int = attrs.field(validator=_positive)
    log_every: int = 10


@attrs.frozen(kw_only=True)
class Run:
    name: str
    seed: int = 0
    model: Choice.of("model")
    optimizer: Choice.of("optimizer")
    loggers: list[Choice.of("logger")] = attrs.Factory(list)
    mesh: MeshSpec = attrs.Factory(MeshSpec)
    training: Training


class ToyPlugin:
    @hookimpl
    def llmtrain_models(self, register):
        register("gpt", object(), options=GptOptions)

    @hookimpl
    def llmtrain_optimizers(self, register):
        register("adamw", object(), options=AdamOptions)

    @hookimpl
    def llmtrain_loggers(self, register):
        register("console", object())
        register("jsonl", object())


@pytest.fixture
def plugins():
    pm = PluginManager(blocked=())
    pm.register(ToyPlugin(), "toy")
    return pm


GOOD = """\
name: demo
model:
  kind: gpt
  n_layers: 4
optimizer:
  kind: adamw
  lr: 3e-4
loggers:
  - kind: console
training:
  steps: 100
"""


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_config_structures_into_the_plugin_options(tmp_path, plugins):
    cfg = load_config(write(tmp_path, GOOD), Run, plugins=plugins)
    assert cfg.model == Choice.of("model")("gpt", GptOptions(n_layers=4))
    assert cfg.optimizer.options.lr == pytest.approx(3e-4)  # YAML 1.1 would read "3e-4" as a str
    assert [logger.kind for logger in cfg.loggers] == ["console"]
    assert cfg.mesh == MeshSpec()
    assert cfg.training == Training(steps=100)


def test_all_problems_reported_at_once_with_paths_and_lines(tmp_path, plugins):
    text = """\
name: 3
model:
  kind: gpt
  n_layers: "4"
  n_head: 8
  dropout: 1
optimizer:
  kind: adamw
  betas: [0.9, "x"]
training:
  steps: 0
extra: true
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), Run, plugins=plugins)
    problems = {p.dotted: p for p in info.value.problems}
    assert set(problems) == {
        "name",
        "model.n_layers",
        "model.n_head",
        "optimizer.betas[1]",
        "training.steps",
        "extra",
    }
    assert problems["name"].message == "expected str, got int 3"
    assert problems["model.n_layers"].message == "expected int, got str '4'"
    assert "did you mean 'n_heads'" in problems["model.n_head"].message
    assert problems["training.steps"].message == "must be at least 1, got 0"
    source = str(tmp_path / "run.yaml")
    assert problems["name"].where == f"{source}:1"
    assert problems["model.n_layers"].where == f"{source}:4"
    assert problems["optimizer.betas[1]"].where == f"{source}:9"
    assert problems["extra"].where == f"{source}:12"
    message = str(info.value)
    assert message.startswith(f"{source}: 6 config problems:")
    assert f"{source}:4: model.n_layers: expected int, got str '4'" in message


@pytest.mark.parametrize(
    ("yaml_value", "field", "expected"),
    [
        ('"false"', "bias", "expected bool (true or false), got str 'false'"),
        ("1", "bias", "expected bool (true or false), got int 1"),
        ("1.7", "n_layers", "expected int, got float 1.7"),
        ("true", "n_layers", "expected int, got bool True"),
        ("true", "dropout", "expected float, got bool True"),
        ("[1]", "dropout", "expected float, got list [1]"),
        # YAML's NaN and infinities are no value any option means
        (".nan", "dropout", "expected a finite number, got nan"),
        (".inf", "dropout", "expected a finite number, got inf"),
        ("-.inf", "dropout", "expected a finite number, got -inf"),
    ],
)
def test_no_lenient_scalar_coercion(tmp_path, plugins, yaml_value, field, expected):
    text = (
        GOOD.replace("  n_layers: 4", f"  n_layers: 4\n  {field}: {yaml_value}")
        if field != "n_layers"
        else GOOD.replace("n_layers: 4", f"n_layers: {yaml_value}")
    )
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), Run, plugins=plugins)
    assert [(p.dotted, p.message) for p in info.value.problems] == [(f"model.{field}", expected)]


def test_cross_field_check_names_its_field(tmp_path, plugins):
    text = GOOD.replace("n_layers: 4", "n_layers: 4\n  n_heads: 5")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), Run, plugins=plugins)
    [problem] = info.value.problems
    assert (problem.dotted, problem.message) == ("model.n_heads", "must divide d_model=64, got 5")


def test_missing_required_keys(tmp_path, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "model: {kind: gpt}\n"), Run, plugins=plugins)
    assert {(p.dotted, p.message) for p in info.value.problems} == {
        ("name", "required key is missing"),
        ("optimizer", "required key is missing"),
        ("training", "required key is missing"),
    }


def test_unknown_kind_lists_the_known_ones(tmp_path, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD.replace("kind: gpt", "kind: gtp")), Run, plugins=plugins)
    [problem] = info.value.problems
    assert problem.dotted == "model.kind"
    assert problem.message == "unknown model 'gtp' (did you mean 'gpt'?); known: gpt"
    assert problem.where.endswith("run.yaml:3")


def test_kind_missing_and_options_on_an_optionless_kind(tmp_path, plugins):
    text = GOOD.replace("  kind: gpt\n", "").replace(
        "- kind: console", "- {kind: console, every: 3}"
    )
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), Run, plugins=plugins)
    assert {(p.dotted, p.message) for p in info.value.problems} == {
        ("model.kind", "missing; known model kinds: gpt"),
        ("loggers[0].every", "logger 'console' takes no options (every)"),
    }


def test_mesh_degrees_validated(tmp_path, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD + "mesh: {tp: 0, dp_shard: -2}\n"), Run, plugins=plugins)
    assert {p.dotted for p in info.value.problems} == {"mesh.tp", "mesh.dp_shard"}


def test_invalid_yaml_names_file_and_line(tmp_path, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "name: demo\nmodel: [\n"), Run, plugins=plugins)
    assert info.value.problems[0].where == f"{tmp_path / 'run.yaml'}:3"
    with pytest.raises(ConfigError, match="duplicate key 'name'"):
        load_config(write(tmp_path, "name: a\nname: b\n"), Run, plugins=plugins)


def test_missing_file_is_a_user_error(tmp_path, plugins):
    with pytest.raises(UserError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml", Run, plugins=plugins)


def test_top_level_must_be_a_mapping(plugins):
    with pytest.raises(ConfigError, match="expected a mapping, got list"):
        structure(parse_yaml("- 1\n"), Run, plugins=plugins)


# -- overrides ---------------------------------------------------------------------------------


def test_overrides_parse_yaml_scalars_and_create_sections(tmp_path, plugins):
    cfg = load_config(
        write(tmp_path, GOOD),
        Run,
        plugins=plugins,
        overrides=[
            "model.n_layers=8",
            "optimizer.lr=1e-2",
            "mesh.tp=2",
            "loggers.0.kind=jsonl",
            "name=x y",
        ],
    )
    assert cfg.model.options.n_layers == 8
    assert cfg.optimizer.options.lr == pytest.approx(0.01)
    assert cfg.mesh.tp == 2
    assert cfg.loggers[0].kind == "jsonl"
    assert cfg.name == "x y"


def test_errors_from_overrides_name_the_override(tmp_path, plugins):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD), Run, plugins=plugins, overrides=["model.n_layers=four"])
    [problem] = info.value.problems
    assert problem.where == "override 'model.n_layers=four'"
    assert problem.message == "expected int, got str 'four'"


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1", "name.x=1", "loggers.5.kind=x"])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError, match="override"):
        apply_overrides(parse_yaml(GOOD), [bad])


# -- dump and reload ---------------------------------------------------------------------------


def test_dump_loads_back_equal(tmp_path, plugins):
    cfg = load_config(write(tmp_path, GOOD), Run, plugins=plugins)
    conv = make_converter(plugins)
    text = dump_config(cfg, converter=conv)
    assert load_config(write(tmp_path, text, "dumped.yaml"), Run, plugins=plugins) == cfg
    assert yaml.safe_load(text)["model"] == {
        "kind": "gpt",
        "n_layers": 4,
        "n_heads": 4,
        "d_model": 64,
        "dropout": 0.0,
        "bias": True,
    }


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n_layers=st.integers(1, 64),
    heads=st.sampled_from([1, 2, 4, 8]),
    lr=st.floats(1e-6, 1.0, allow_nan=False),
    seed=st.integers(0, 2**31),
    tp=st.sampled_from([1, 2]),
)
def test_round_trip_property(plugins, n_layers, heads, lr, seed, tp):
    cfg = Run(
        name="p",
        seed=seed,
        model=Choice.of("model")("gpt", GptOptions(n_layers=n_layers, n_heads=heads)),
        optimizer=Choice.of("optimizer")("adamw", AdamOptions(lr=lr)),
        mesh=MeshSpec(tp=tp),
        training=Training(steps=1),
    )
    conv = make_converter(plugins)
    assert structure(parse_yaml(dump_config(cfg, converter=conv)), Run, plugins=plugins) == cfg


# -- generated bad configs: never a traceback, always a message with a path --------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
keys = st.sampled_from(
    [
        "name",
        "seed",
        "model",
        "model.kind",
        "model.n_layers",
        "model.n_heads",
        "model.dropout",
        "model.bias",
        "model.bogus",
        "optimizer",
        "optimizer.lr",
        "optimizer.betas",
        "optimizer.kind",
        "loggers",
        "loggers.0",
        "mesh",
        "mesh.tp",
        "mesh.dp_shard",
        "training",
        "training.steps",
        "unknown_top",
    ]
)


def _set(data, dotted, value):
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        key = int(part) if part.isdigit() else part
        if isinstance(node, list):
            if not isinstance(key, int) or key >= len(node):
                return
            nxt = node[key]
        else:
            nxt = node.get(key)
        if not isinstance(nxt, (dict, list)):
            nxt = {}
            node[key] = nxt
        node = nxt
    last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if isinstance(node, list):
        if isinstance(last, int) and last < len(node):
            node[last] = value
    else:
        node[last] = value


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(keys, scalars), min_size=1, max_size=5))
def test_generated_bad_configs_give_messages_with_paths(plugins, mutations):
    data = yaml.safe_load(GOOD)
    for key, value in mutations:
        _set(data, key, value)
    try:
        structure(data, Run, plugins=plugins, source="gen.yaml")
    except ConfigError as exc:
        assert exc.problems, "a ConfigError must carry at least one problem"
        for problem in exc.problems:
            assert problem.message
            assert problem.path, f"problem without a path: {problem}"
            assert problem.dotted.split(".")[0].split("[")[0] in {
                "name",
                "seed",
                "model",
                "optimizer",
                "loggers",
                "mesh",
                "training",
                "unknown_top",
            }


def test_entry_defaults_act_as_a_preset_under_the_given_keys():
    class Presets:
        @hookimpl
        def llmtrain_models(self, register):
            register(
                "gpt-deep", object(), options=GptOptions, defaults={"n_layers": 48, "d_model": 128}
            )

    pm = PluginManager(blocked=())
    pm.register(Presets(), "presets")
    cfg = structure({"kind": "gpt-deep", "n_heads": 8}, Choice.of("model"), plugins=pm)
    assert cfg.options == GptOptions(n_layers=48, d_model=128, n_heads=8)
    cfg = structure({"kind": "gpt-deep", "n_layers": 2}, Choice.of("model"), plugins=pm)
    assert (cfg.options.n_layers, cfg.options.d_model) == (2, 128)
    with pytest.raises(ConfigError) as info:
        structure({"kind": "gpt-deep", "n_heads": 3}, Choice.of("model"), plugins=pm)
    assert [p.dotted for p in info.value.problems] == ["n_heads"]


def test_literal_choices_are_listed():
    @attrs.frozen
    class Norm:
        norm: Literal["layernorm", "rmsnorm"] = "layernorm"

    assert structure({"norm": "rmsnorm"}, Norm) == Norm("rmsnorm")
    with pytest.raises(ConfigError) as info:
        structure({"norm": "batchnorm"}, Norm)
    assert [p.message for p in info.value.problems] == [
        "expected one of 'layernorm', 'rmsnorm', got 'batchnorm'"
    ]


def test_a_list_field_takes_only_a_list():
    """cattrs alone would read `tags: ci` as ['c', 'i'] and a mapping as its keys."""

    @attrs.frozen
    class Tagged:
        tags: list[str] = attrs.Factory(list)
        sizes: list[int] = attrs.Factory(list)

    assert structure({"tags": ["ci", "gpu"], "sizes": [1, 2]}, Tagged) == Tagged(
        ["ci", "gpu"], [1, 2]
    )
    with pytest.raises(ConfigError) as info:
        structure({"tags": "ci", "sizes": {"a": 1}}, Tagged)
    assert sorted((p.dotted, p.message) for p in info.value.problems) == [
        ("sizes", "expected a list, got mapping {'a': 1}"),
        ("tags", "expected a list, got str 'ci'"),
    ]
    with pytest.raises(ConfigError) as info:
        structure({"sizes": [1, "two"]}, Tagged)
    assert [(p.dotted, p.message) for p in info.value.problems] == [
        ("sizes[1]", "expected int, got str 'two'")
    ]


# -- fields whose YAML key is a Python keyword -------------------------------------------------


def _not_empty(instance, attribute, value):
    if not value:
        raise ValueError("must not be empty")


@attrs.frozen(kw_only=True)
class Source:
    from_: str = attrs.field(metadata={YAML_KEY: "from"}, validator=_not_empty)
    step: int | None = None


@attrs.frozen(kw_only=True)
class WithSource:
    name: str
    init: Source | None = None


def test_yaml_key_metadata_names_the_field_everywhere(tmp_path):
    """`from_` is `from` in YAML: structured, dumped, overridden and named in errors as such."""
    path = write(tmp_path, "name: a\ninit:\n  from: runs/x/checkpoints\n  step: 3\n")
    cfg = load_config(path, WithSource)
    assert cfg.init == Source(from_="runs/x/checkpoints", step=3)
    text = dump_config(cfg)
    assert yaml.safe_load(text)["init"] == {"from": "runs/x/checkpoints", "step": 3}
    assert load_config(write(tmp_path, text, "dumped.yaml"), WithSource) == cfg
    assert load_config(path, WithSource, overrides=["init.from=s3://b/c"]).init.from_ == "s3://b/c"

    bad = write(tmp_path, "name: a\ninit:\n  step: 1\n  frm: x\n", "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(bad, WithSource)
    assert sorted(map(str, info.value.problems)) == [
        f"{bad}:2: init.from: required key is missing",
        f"{bad}:4: init.frm: unknown key (did you mean 'from'?); allowed: from, step",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(path, WithSource, overrides=["init.from=3", "init.step=x"])
    assert sorted((p.dotted, p.where, p.message) for p in info.value.problems) == [
        ("init.from", "override 'init.from=3'", "expected str, got int 3"),
        ("init.step", "override 'init.step=x'", "expected int, got str 'x'"),
    ]
    with pytest.raises(ConfigError) as info:
        load_config(path, WithSource, overrides=["init.from="])
    assert [(p.dotted, p.message) for p in info.value.problems] == [
        ("init.from", "must not be empty")
    ]


@attrs.frozen(kw_only=True)
class _Item:
    path: str
    name: str | None = None


@attrs.frozen(kw_only=True)
class _OneOrMany:
    item: _Item | list[_Item] | None = None
    required: _Item | list[_Item]


def test_an_option_that_takes_one_item_or_a_list_of_them():
    """A mapping is the one item, a list the list, null None where allowed; each round-trips."""
    one = structure({"item": {"path": "a"}, "required": [{"path": "b", "name": "x"}]}, _OneOrMany)
    assert one == _OneOrMany(item=_Item(path="a"), required=[_Item(path="b", name="x")])
    assert structure(yaml.safe_load(dump_config(one)), _OneOrMany) == one
    assert structure({"item": None, "required": {"path": "c"}}, _OneOrMany).item is None
    for value, message in (
        ("x", "item: expected a mapping or a list of mappings, got str 'x'"),
        ([{"path": "a", "nam": "b"}], "item[0].nam: unknown key (did you mean 'name'?)"),
        ({"path": 3}, "item.path: expected str, got int 3"),
    ):
        with pytest.raises(ConfigError) as caught:
            structure({"item": value, "required": {"path": "c"}}, _OneOrMany)
        assert message in str(caught.value)
    with pytest.raises(ConfigError, match="required: expected a mapping or a list"):
        structure({"required": None}, _OneOrMany)
