"""Model ladders (`llmtrain sweep BASE --ladder`): the shape rule and its exact parameter counts,
the steps per rung, the dry-run table, the configs a ladder writes, and the refusals. Budgets are
tiny (1e13 to 1e15 FLOPs) for the `tiny` model kind; nothing trains."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import attrs
import pytest
import torch
import yaml

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import hookimpl
from llmtrain.train_loop.experiments import ladder, ladder_shapes
from llmtrain.train_loop.experiments.sweep import ladder_base

MICRO, SEQ = 8, 64  # 512 tokens per step on one process
BUDGETS = (1e13, 1e14, 1e15)


def write_base(tmp_path, model: str = "{kind: tiny, vocab_size: 320, max_seq_len: 64}", **data):
    """A base config: the tiny preset (head_dim 16, 4 query heads per 2 kv heads)."""
    data_lines = "".join(f"  {key}: {value}\n" for key, value in data.items())
    path = tmp_path / "base.yaml"
    path.write_text(
        f"name: lad\ndevice: cpu\nmodel: {model}\n"
        f"data:\n  train: [{{path: {tmp_path}/none.zarr}}]\n  seq_len: {SEQ}\n"
        f"  micro_batch: {MICRO}\n{data_lines}"
        "optimizer: {kind: adamw, lr: 3.0e-3}\ntraining: {steps: 10}\n",
        encoding="utf-8",
    )
    return path


def rungs_of(base, plugins, budgets=BUDGETS, ratios=(10, 20, 40), world=1):
    config = ladder_base(str(base), plugins)
    return ladder.ladder(config, plugins, budgets=budgets, ratios=ratios, world=world)


def built_non_embedding_params(plugins, base, shape) -> int:
    """The model really built (on the CPU, weights allocated) with this shape, its parameters
    less the token and position embeddings, counted here rather than by describe()."""
    config = ladder_base(str(base), plugins)
    options = attrs.evolve(config.model.options, **shape)
    model = plugins.build("model", attrs.evolve(config.model, options=options))
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if not name.startswith(("tok_emb.", "pos_emb."))
    )


# --- the shape rule ---


def test_shapes_keep_head_dim_kv_ratio_and_aspect_band_and_land_near_n(installed, tmp_path):
    base = write_base(tmp_path)
    rungs = rungs_of(base, installed)
    assert [(r.budget, r.tokens_per_param) for r in rungs] == [
        (c, r) for c in BUDGETS for r in (10, 20, 40)
    ]
    for rung in rungs:
        shape = rung.shape
        assert rung.target_params == pytest.approx(
            math.sqrt(rung.budget / (6 * rung.tokens_per_param))
        )
        assert shape["d_model"] == 16 * shape["n_heads"]  # head_dim of the tiny preset
        assert shape["n_heads"] == 2 * shape["n_kv_heads"]  # its query heads per kv head
        assert 32 <= shape["d_model"] / shape["n_layers"] <= 128
        assert "mlp_hidden" not in shape  # the preset derives it from d_model
        assert abs(rung.params / rung.target_params - 1) <= ladder_shapes.TOLERANCE
    # the biggest rungs have fine enough shapes to land within a few percent
    assert all(abs(r.params / r.target_params - 1) < 0.04 for r in rungs if r.budget == 1e15)
    # more compute, bigger model at every ratio; more tokens per parameter, smaller model
    for ratio in (10, 20, 40):
        sizes = [r.params for r in rungs if r.tokens_per_param == ratio]
        assert sizes == sorted(sizes) and len(set(sizes)) == 3
    for budget in BUDGETS:
        sizes = [r.params for r in rungs if r.budget == budget]
        assert sizes == sorted(sizes, reverse=True)


def test_the_count_is_the_built_model_s_and_the_formula_s(installed, tmp_path):
    base = write_base(tmp_path)
    rungs = rungs_of(base, installed, budgets=(1e13, 1e14), ratios=(10, 20))
    for rung in rungs:
        assert rung.params == built_non_embedding_params(installed, base, rung.shape)
    # by hand, C=1e13 r=10: d_model 128, 2 layers, 8 heads of 16, 4 kv heads, SwiGLU hidden
    # int(8 * 128 / 3) = 341 rounded up to 352, RMSNorm weights, no biases
    first = rungs[0]
    assert first.shape == {"d_model": 128, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4}
    per_layer = 128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 352 + 2 * 128
    assert first.params == 2 * per_layer + 128 == 369_280
    # training FLOPs per token: 6 x (N + the tied head's 320 x 128) plus attention's
    # 12 x layers x heads x head_dim x seq_len
    assert first.flops_per_token == 6 * (369_280 + 320 * 128) + 12 * 2 * 8 * 16 * SEQ


def test_a_base_mlp_hidden_scales_with_d_model(installed, tmp_path):
    model = "{kind: tiny, vocab_size: 320, max_seq_len: 64, mlp_hidden: 256, n_kv_heads: null}"
    base = write_base(tmp_path, model=model)  # mlp_hidden 4 x d_model 64; plain multi-head
    rungs = rungs_of(base, installed, budgets=(1e14,), ratios=(20,))
    shape = rungs[0].shape
    assert shape["mlp_hidden"] == 4 * shape["d_model"]  # a multiple of mlp_multiple_of 32 too
    assert "n_kv_heads" not in shape
    assert rungs[0].params == built_non_embedding_params(installed, base, shape)


def test_the_aspect_band_is_a_flag(installed, tmp_path):
    base = write_base(tmp_path)
    config = ladder_base(str(base), installed)
    narrow = ladder.ladder(config, installed, budgets=(1e15,), ratios=(20,), aspect=(60.0, 70.0))
    d_model, n_layers = narrow[0].shape["d_model"], narrow[0].shape["n_layers"]
    assert 60 <= d_model / n_layers <= 70


# --- steps ---


@pytest.mark.parametrize(
    ("world", "data", "step_tokens"),
    [(1, {}, MICRO * SEQ), (2, {}, 2 * MICRO * SEQ), (2, {"grad_accum": 3}, 6 * MICRO * SEQ)],
)
def test_steps_reach_d_within_one_step(installed, tmp_path, world, data, step_tokens):
    base = write_base(tmp_path, **data)
    config = ladder_base(str(base), installed)
    assert ladder.tokens_per_step(config, world, str(base)) == step_tokens
    for rung in rungs_of(base, installed, world=world):
        # D spends the budget in the model's own FLOPs per token (6N plus attention)
        assert rung.flops_per_token > 6 * rung.params
        wanted = rung.budget / rung.flops_per_token
        assert rung.target_tokens == pytest.approx(wanted)
        assert rung.tokens == rung.steps * step_tokens
        assert wanted <= rung.tokens < wanted + step_tokens
        assert rung.actual_budget == rung.flops_per_token * rung.tokens
        assert rung.budget <= rung.actual_budget < rung.budget + rung.flops_per_token * step_tokens


def test_global_batch_tokens_sets_the_step(installed, tmp_path):
    base = write_base(tmp_path, global_batch_tokens=4096)
    (rung,) = rungs_of(base, installed, budgets=(1e14,), ratios=(20,), world=2)
    assert rung.steps == math.ceil(rung.target_tokens / 4096)


def test_budget_labels_read_as_written():
    assert [ladder_shapes.compact(c) for c in (1e15, 3e15, 1.5e16, 1e11, 250.0)] == [
        "1e15",
        "3e15",
        "1.5e16",
        "1e11",
        "250",
    ]


# --- through the command ---


def table_rows(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.strip().splitlines()]
    assert lines[0][:2] == ["run", "id"]
    return lines[1:]


def test_dry_run_prints_the_table_and_writes_nothing(installed, tmp_path, run_cli):
    base = write_base(tmp_path)
    sweeps = tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, "--ladder", "--budgets", "1e13,1e15", "--tokens-per-param", "20",
        "--dry-run", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err
    assert not sweeps.exists()
    expected = rungs_of(base, installed, budgets=(1e13, 1e15), ratios=(20,))
    rows = table_rows(out)
    assert [row[0] for row in rows] == ["C=1e13,r=20", "C=1e15,r=20"]
    for row, rung in zip(rows, expected, strict=True):
        assert row[1:] == [
            ladder_shapes.compact(rung.budget),
            "20",
            f"{rung.params:,}",
            f"{rung.tokens:,}",
            f"{rung.tokens / rung.params:.1f}",
            ladder_shapes.compact(rung.actual_budget),
            str(rung.shape["n_layers"]),
            str(rung.shape["d_model"]),
            str(rung.shape["n_heads"]),
            str(rung.steps),
        ]
    # N = 304,800 (d_model 96, 3 layers of 6 heads) for a target of 288,675; its FLOPs per
    # token 6 x (304,800 + the tied head's 320 x 96) + 12 x 3 x 6 x 16 x 64 = 2,234,304, so
    # D = 1e13 / 2,234,304 = 4,475,667 tokens: 8,742 steps of 512
    assert rows[0][3:6] == ["304,800", "4,475,904", "14.7"]


def test_launch_print_writes_configs_with_the_overrides(installed, tmp_path, run_cli):
    base = write_base(tmp_path)
    sweeps = tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, "--ladder", "--budgets", "1e13,1e14", "--tokens-per-param", "10,40",
        "--seeds", "2", "--launch", "print", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err
    rungs = rungs_of(base, installed, budgets=(1e13, 1e14), ratios=(10, 40))
    manifest = json.loads((sweeps / "lad" / "manifest.json").read_text())
    ids = [run["id"] for run in manifest["runs"]]
    assert ids == [f"{label},seed={s}" for label in ("C=1e13,r=10", "C=1e13,r=40",
                   "C=1e14,r=10", "C=1e14,r=40") for s in (0, 1)]  # fmt: skip
    assert len(out.strip().splitlines()) == 8  # one printed command per run
    assert [entry["params"] for entry in manifest["ladder"]] == [r.params for r in rungs]
    for i, run_id in enumerate(ids):
        rung = rungs[i // 2]
        written = yaml.safe_load((sweeps / "lad" / run_id / "config.yaml").read_text())
        model = written["model"]
        got = {k: model[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads")}
        assert got == rung.shape
        assert written["training"]["steps"] == rung.steps
        assert written["seed"] == i % 2
        assert manifest["runs"][i]["settings"]["training.steps"] == rung.steps
    assert "C=1e13,r=10,seed=0" in err  # the table goes to stderr when the sweep is written


def test_a_base_with_training_tokens_gets_steps_instead(installed, tmp_path, run_cli):
    base = write_base(tmp_path)
    base.write_text(base.read_text().replace("{steps: 10}", "{tokens: 100000}"))
    sweeps = tmp_path / "sweeps"
    code, _, err = run_cli(
        "sweep", base, "--ladder", "--budgets", "1e13", "--tokens-per-param", "20",
        "--launch", "print", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err
    training = yaml.safe_load((sweeps / "lad" / "C=1e13,r=20" / "config.yaml").read_text())[
        "training"
    ]
    assert (training["steps"], training["tokens"]) == (8742, None)  # as in the dry-run test


# --- refusals ---


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budgets", "1e13"], "--ladder needs --tokens-per-param with one or more"),
        (["--tokens-per-param", "20"], "--ladder needs --budgets with one or more"),
        (["--budgets", "1e13", "--tokens-per-param", ""], "--ladder needs --tokens-per-param"),
        (["--budgets=0,1e13", "--tokens-per-param", "20"], "--budgets: 0 is not positive"),
        (["--budgets=-1e13", "--tokens-per-param", "20"], "--budgets: -1e13 is not positive"),
        (["--budgets", "1e13", "--tokens-per-param", "20,x"], "--tokens-per-param: 'x' is not"),
        (["--budgets", "1e13,1e13", "--tokens-per-param", "20"], "1e13 is given twice"),
        (["--budgets", "1e13", "--tokens-per-param", "20", "--aspect-ratio", "128,32"], "MIN,MAX"),
        (["--budgets", "1e13", "--tokens-per-param", "20", "--grid", "model.n_layers=2,4"],
         "refused: model.n_layers (--grid 'model.n_layers=2,4')"),
        (["--budgets", "1e13", "--tokens-per-param", "20", "--zip", "data.micro_batch=4,8"],
         "refused: data.micro_batch (--zip 'data.micro_batch=4,8')"),
    ],
)  # fmt: skip
def test_bad_ladders_are_one_line_errors(tmp_path, run_cli, args, message):
    sweeps = tmp_path / "sweeps"
    code, _, err = run_cli("sweep", write_base(tmp_path), "--ladder", *args, "--dir", sweeps)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and message in line, line
    assert not sweeps.exists()


def alone(plugins, base, budget, ratio) -> str | None:
    """Why the rung (budget, ratio) fails on its own, or None when it has a shape."""
    try:
        rungs_of(base, plugins, budgets=(budget,), ratios=(ratio,))
    except UserError as exc:
        (line,) = [line for line in str(exc).splitlines() if line.startswith("  C=")]
        return line
    return None


def failing_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("  C=")]


def suggested(err: str, prefix: str) -> list[float]:
    (line,) = [line for line in err.splitlines() if line.startswith(prefix)]
    return [float(value) for value in line.split()[-1].split(",")]


def test_every_failing_rung_is_listed_with_the_smallest_budget_that_works(
    installed, tmp_path, run_cli
):
    base = write_base(tmp_path)
    budgets, ratios = (1e9, 1e12, 1e13, 2e13), (10, 20, 40)
    sweeps = tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, "--ladder", "--budgets", "1e9,1e12,1e13,2e13", "--tokens-per-param",
        "10,20,40", "--dir", sweeps,
    )  # fmt: skip
    assert code == 2 and out == "" and not sweeps.exists()
    lines = err.strip().splitlines()
    # one message, naming the flag: every failing rung, nothing else
    assert lines[0].startswith("error: --budgets 1e9,1e12,1e13,2e13: ")
    expected = [
        why for c in budgets for r in ratios if (why := alone(installed, base, c, r)) is not None
    ]
    assert failing_lines(err) == expected
    assert f"{len(expected)} of 12 rungs have no model shape" in lines[0]
    # all of 1e9 is below the smallest shape; some of 1e12 is between shapes; 1e13 works
    assert sum("C=1e9," in line for line in expected) == 3
    assert all("below the smallest shape (d_model 32, 1 layer: " in line for line in expected[:3])
    assert any("C=1e12," in line and "off, more than 10%" in line for line in expected)
    assert not any("C=1e13," in line for line in expected)
    assert "N = 4,082: below" in expected[0]  # sqrt(1e9 / 60)

    # the smallest budget reported works for every ratio, and none below it does
    (smallest,) = suggested(err, "the smallest budget with a shape for every ratio")
    rungs_of(base, installed, budgets=(smallest,), ratios=ratios)  # raises if it does not work
    config = ladder_base(str(base), installed)
    options = installed.options_of("model", config.model)
    rule = ladder_shapes.shape_rule(options, "tiny", ladder.DEFAULT_ASPECT)
    describe = ladder_shapes.meta_describer(installed, config.model)
    space = ladder_shapes.ShapeSpace(rule, lambda shape: describe(shape).n_non_embedding_params)
    # rounded up to 2 significant digits: at most 10% above the exact smallest one
    for i in range(200):
        below = smallest / 1.1 * (1e-3) ** (i / 200)
        assert any(space.problem(math.sqrt(below / (6 * r))) is not None for r in ratios), below

    # the next working budgets above the failing ones: the ladder they make runs
    fixed = suggested(err, "the next budgets that work above the failing ones")
    # 1e9 and 1e12 both move up to the smallest working budget (once); working ones stay
    assert fixed == [smallest, 1e13, 2e13] and 1e12 < smallest < 1e13
    assert len(rungs_of(base, installed, budgets=fixed, ratios=ratios)) == 9
    code, out, err = run_cli(
        "sweep", base, "--ladder", "--budgets", ",".join(map(str, fixed)),
        "--tokens-per-param", "10,20,40", "--dry-run", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err


def test_a_budget_between_shapes_names_the_nearest_shape(installed, tmp_path):
    with pytest.raises(UserError) as info:
        rungs_of(write_base(tmp_path), installed, budgets=(1e12,), ratios=(10,))
    # N = sqrt(1e12 / 60) = 129,099: d_model 96 with 2 layers (or 128 with 1) is too far off
    (line,) = failing_lines(str(info.value))
    assert line.startswith("  C=1e12, r=10: N = 129,099: the nearest shape (d_model ")
    assert "more than 10%" in line


def test_the_too_small_error_names_the_smallest_shape(installed, tmp_path):
    with pytest.raises(UserError) as info:
        rungs_of(write_base(tmp_path), installed, budgets=(1e9,), ratios=(20,))
    # the smallest shape: d_model 32 (head_dim 16 x 2 query heads per kv head), 1 layer
    smallest = built_non_embedding_params(
        installed,
        tmp_path / "base.yaml",
        {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
    )
    assert f"below the smallest shape (d_model 32, 1 layer: {smallest:,} parameters)" in str(
        info.value
    )
    # one ratio: its smallest budget puts N at the smallest shape, rounded up
    (budget,) = suggested(str(info.value), "the smallest budget")
    assert 6 * 20 * smallest**2 <= budget <= 1.1 * 6 * 20 * smallest**2


# the keys a ladder sets, given by hand in every spelling and place: the same refusal, before
# the base is read or anything is sized (a budget of 1e9 would fail to size)
@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["model.n_heads=8"], "model.n_heads (override 'model.n_heads=8')"),
        (["model={kind: tiny, vocab_size: 320, max_seq_len: 64, n_heads: 8}"],
         "model.n_heads (override 'model={kind: tiny, vocab_size: 320, max_seq_len: 64, "
         "n_heads: 8}')"),
        (["model.n_kv_heads=null"], "model.n_kv_heads (override 'model.n_kv_heads=null')"),
        (["model.mlp_hidden=256"], "model.mlp_hidden (override 'model.mlp_hidden=256')"),
        (["training={steps: 5}"], "training.steps (override 'training={steps: 5}')"),
        (["training.tokens=100000"], "training.tokens (override 'training.tokens=100000')"),
        (["--grid", "model.n_heads=8,16"], "model.n_heads (--grid 'model.n_heads=8,16')"),
        (["--zip", "model.n_heads=8,16", "--zip", "optimizer.lr=0.1,0.2"],
         "model.n_heads (--zip 'model.n_heads=8,16')"),
        (["--grid", "model={kind: tiny}"], "model (--grid 'model={kind: tiny}')"),
    ],
)  # fmt: skip
def test_ladder_keys_are_refused_the_same_way_in_every_spelling(tmp_path, run_cli, argv, refused):
    code, _, err = run_cli(
        "sweep", write_base(tmp_path), "--ladder", "--budgets", "1e9", "--tokens-per-param",
        "20", "--dry-run", *argv,
    )  # fmt: skip
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("error: --ladder sets each rung's model.d_model, model.n_layers, ")
    assert f"; refused: {refused}. Give the base's shape in the base config file" in line


def test_every_refused_key_is_named_at_once(tmp_path, run_cli):
    code, _, err = run_cli(
        "sweep", write_base(tmp_path), "--ladder", "--budgets", "1e13", "--tokens-per-param",
        "20", "--dry-run", "model.n_heads=8", "training.steps=3", "--grid", "data.seq_len=32,64",
    )  # fmt: skip
    assert code == 2
    assert (
        "refused: model.n_heads (override 'model.n_heads=8'); training.steps (override "
        "'training.steps=3'); data.seq_len (--grid 'data.seq_len=32,64')."
    ) in err


def test_the_base_file_and_other_overrides_give_the_shape(installed, tmp_path, run_cli):
    """n_heads in the base file sets head_dim; overrides of keys no rung sets are the base's."""
    base = write_base(tmp_path, model="{kind: tiny, vocab_size: 320, max_seq_len: 64, n_heads: 8}")
    for extra in ([], ["model.vocab_size=400"], ["model={kind: tiny, max_seq_len: 64}"]):
        code, _, err = run_cli(
            "sweep", base, "--ladder", "--budgets", "1e13", "--tokens-per-param", "20",
            "--dry-run", *extra,
        )  # fmt: skip
        assert code == 0, (extra, err)
    # without --ladder the same override is an ordinary one
    code, _, err = run_cli(
        "sweep", base, "--grid", "optimizer.lr=0.1,0.2", "model.n_heads=2", "--dry-run"
    )
    assert code == 0, err
    (rung,) = rungs_of(base, installed, budgets=(1e13,), ratios=(20,))
    assert rung.shape["d_model"] == 8 * rung.shape["n_heads"]  # head_dim 64 / 8


# --- the laptop preset ---

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ladder-laptop.yaml"


def test_the_laptop_preset_sizes_the_example_for_a_cpu(installed, tmp_path, run_cli):
    code, out, err = run_cli(
        "sweep", EXAMPLE, "--ladder", "--preset", "laptop", "--dry-run", "--dir", tmp_path
    )  # fmt: skip
    assert code == 0, err
    preset = ladder.PRESETS["laptop"]
    ids = [f"C={ladder_shapes.compact(c)},r={r:g}" for c in preset.budgets for r in preset.ratios]
    assert [row[0] for row in table_rows(out)] == ids
    rungs = ladder.ladder(
        ladder_base(str(EXAMPLE), installed),
        installed,
        budgets=preset.budgets,
        ratios=preset.ratios,
        aspect=preset.aspect,
    )
    # laptop-sized: small models, under 3M tokens in all (about two minutes on a CPU); two
    # budgets of three sizes each, for two IsoFLOP profiles
    assert all(r.shape["d_model"] <= 128 and r.shape["n_layers"] <= 4 for r in rungs)
    assert all(16 <= r.shape["d_model"] / r.shape["n_layers"] <= 64 for r in rungs)
    assert sum(r.tokens for r in rungs) < 3_000_000
    for budget in preset.budgets:
        assert len({r.params for r in rungs if r.budget == budget}) == 3


def test_flags_given_with_a_preset_replace_its_values(tmp_path, run_cli):
    code, _, err = run_cli(
        "sweep", EXAMPLE, "--ladder", "--preset", "laptop", "--budgets", "1e12",
        "--launch", "print", "--dir", tmp_path,
    )  # fmt: skip
    assert code == 0, err
    manifest = json.loads((tmp_path / "laptop" / "manifest.json").read_text())
    assert [run["id"] for run in manifest["runs"]] == ["C=1e12,r=2", "C=1e12,r=8", "C=1e12,r=32"]
    assert (
        manifest["command"].split(" --dir ")[0].endswith("--ladder --preset laptop --budgets 1e12")
    )
    # the preset's aspect band still applies
    assert all(16 <= row["d_model"] / row["n_layers"] <= 64 for row in manifest["ladder"])


def test_a_preset_needs_ladder_and_a_known_name(tmp_path, run_cli):
    code, _, err = run_cli("sweep", EXAMPLE, "--preset", "laptop", "--dry-run")
    assert code == 2 and "--preset size a model ladder: add --ladder" in err
    code, _, err = run_cli("sweep", EXAMPLE, "--ladder", "--preset", "desktop", "--dry-run")
    assert code == 2 and "argument --preset: invalid choice: 'desktop'" in err  # as in --help


def test_ladder_flags_need_ladder(tmp_path, run_cli):
    code, _, err = run_cli("sweep", write_base(tmp_path), "--budgets", "1e13", "--dry-run")
    assert code != 0 and "--budgets size a model ladder: add --ladder" in err


@attrs.frozen(kw_only=True)
class WidthOptions:
    """A model kind sized by other keys than a transformer's."""

    training_only: ClassVar[frozenset[str]] = frozenset()
    vocab_size: int = 320
    max_seq_len: int = 64
    doc_masking: bool = False
    width: int = 64
    depth: int = 2


class WidthPlugin:
    @hookimpl
    def llmtrain_models(self, register):
        register("widthy", lambda options: torch.nn.Linear(1, 1), options=WidthOptions)


def test_a_model_kind_without_shape_keys_is_refused(installed, tmp_path, capsys, run_cli):
    # run_cli: its teardown undoes the logging the CLI sets up; main runs on `installed` here
    installed.register(WidthPlugin(), "width-plugin")
    base = write_base(tmp_path, model="{kind: widthy}")
    argv = ["sweep", str(base), "--ladder", "--budgets", "1e13", "--tokens-per-param", "20"]
    assert main([*argv, "--dry-run"], plugins=installed) != 0
    err = capsys.readouterr().err
    assert (
        "error: --ladder: model kind 'widthy' (WidthOptions) has no d_model, n_layers, n_heads"
        in err
    )
