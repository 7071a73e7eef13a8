"""µP through `llmtrain run` on CPU: a µP tiny model (width multiplier 2) trains in one process
with its hidden matrices at half the configured AdamW lr while the log shows the configured lr;
2 gloo ranks under torchrun (FSDP, TP, a 2-stage pipeline) log the same numbers as one process,
so every model part gets its multipliers by name; and a resume from a checkpoint, in one process
or on a pipeline's 2 ranks, continues the run it came from. Each run is a real
`python -m llmtrain` subprocess (the patterns of test_train_e2e.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import train_support as ts
import yaml

from llmtrain.train_loop.schedules import WarmupOptions, cosine

RTOL = 1e-4  # float32 sums taken in another order
LR = 3e-3  # run_config's AdamW lr
HIDDEN = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """One process, 30 steps of the shared config with the tiny model (d_model 32) under µP at
    base width 16: m = 2."""
    tmp = tmp_path_factory.mktemp("reference")
    config = ts.run_config(data, tmp / "runs", name="ref")
    config["model"].update(parametrization="mup", mup_base_width=16)
    return ts.one_process_run(tmp, config)


def saved_groups(run_dir, config: dict, step: int) -> dict[str, dict]:
    """The optimizer group values the checkpoint at `step` holds, by parameter name: loaded into
    a fresh model and AdamW as a resume loads them (in this process, without a process group)."""
    import warnings

    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.checkpoint.state import ModelState
    from llmtrain.models.presets import preset_config
    from llmtrain.models.transformer import build_model
    from llmtrain.train_loop.optim import AdamOptions, adamw

    options = {k: v for k, v in config["model"].items() if k != "kind"}
    model = build_model(preset_config("tiny", **options))
    optimizers = adamw(AdamOptions(lr=LR), model)
    with warnings.catch_warnings():  # DCP's note that it loads in a single process
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        Checkpointer(str(run_dir / "checkpoints")).load(
            {"train": ModelState([model], [optimizers])}, step=step, restore_rng=False
        )
    named = {id(p): n for n, p in model.named_parameters()}
    return {
        named[id(p)]: {k: v for k, v in g.items() if k != "params"}
        for g in optimizers[0].param_groups
        for p in g["params"]
    }


def test_a_mup_run_trains_with_scaled_groups_and_logs_the_configured_lr(reference):
    proc, run_dir, metrics = reference["proc"], reference["dir"], reference["metrics"]
    assert "Traceback" not in proc.stderr and ts.error_lines(proc.stderr) == []
    assert list(metrics) == list(range(1, 31))
    early = sum(metrics[s]["loss"] for s in range(1, 6)) / 5
    late = sum(metrics[s]["loss"] for s in range(26, 31)) / 5
    assert late < early - 0.8, (early, late)
    # the log shows the configured lr under the schedule, not a µP group's half of it
    schedule = cosine(WarmupOptions(warmup_steps=3, min_ratio=0.1), 30)
    for step, m in metrics.items():
        assert m["lr"] == pytest.approx(LR * schedule(step - 1), rel=1e-12), step

    # the parametrization is in the resolved config and in what the checkpoint records
    model = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert (model["parametrization"], model["mup_base_width"]) == ("mup", 16)
    info = json.loads((run_dir / "checkpoints" / "step-10" / "llmtrain.json").read_text())
    assert info["info"]["model"]["parametrization"] == "mup"
    assert info["info"]["model"]["mup_base_width"] == 16

    # step 10 ran at lr x schedule(9), the hidden matrices at half that: as saved
    groups = saved_groups(run_dir, reference["config"], 10)
    at_10 = LR * schedule(9)
    for name, group in groups.items():
        hidden = name.startswith("blocks.") and name.removesuffix(".weight").endswith(HIDDEN)
        multiplier = 0.5 if hidden else 1.0
        assert group["lr_multiplier"] == multiplier, name
        assert group["base_lr"] == LR, name
        assert group["lr"] == pytest.approx(at_10 * multiplier, rel=1e-12), name
    assert sum(g["lr_multiplier"] == 0.5 for g in groups.values()) == 2 * len(HIDDEN)


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("fsdp", []),  # the default mesh: dp_shard -1
        ("tp", ["mesh.tp=2"]),
        ("pp", ["mesh.pp=2"]),  # one block per stage, each stage's optimizer its own
    ],
)
def test_two_ranks_log_the_same_numbers_as_one_process(reference, layout, overrides):
    name = f"two-{layout}"
    proc = ts.run(
        ts.torchrun(
            2, "run", reference["path"], f"name={name}", "training.checkpoint_every=null",
            *overrides,
        ),
        timeout=600,
    )  # fmt: skip
    assert ts.error_lines(proc.stderr) == []
    run_dir = reference["tmp"] / "runs" / name
    start = json.loads((run_dir / "logs" / "rank0.jsonl").read_text().splitlines()[0])
    assert start["event"] == "run.start" and start["world"] == 2
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(1, 31))
    ts.assert_close_runs(
        reference["metrics"], got, RTOL, ["loss", "grad_norm", "lr", "eval_loss", "tokens"]
    )


def resume_from_step_10(reference, name: str):
    run_dir = reference["tmp"] / "runs" / name
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        reference["dir"] / "checkpoints" / "step-10", run_dir / "checkpoints" / "step-10"
    )
    return run_dir


def test_a_resumed_mup_run_continues_exactly(reference):
    run_dir = resume_from_step_10(reference, "resumed")
    proc = ts.run(ts.llmtrain("run", reference["path"], "name=resumed"), timeout=600)
    assert "run.resumed" in proc.stderr
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(11, 31))
    want = reference["metrics"]
    for step, m in got.items():
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            if key not in want[step]:  # eval_loss: on eval steps only
                assert key not in m, (step, key)
            else:
                assert m[key] == pytest.approx(want[step][key], rel=1e-6), (step, key)
    # the groups it saved are the uninterrupted run's
    assert saved_groups(run_dir, reference["config"], 30) == saved_groups(
        reference["dir"], reference["config"], 30
    )


def test_a_pipeline_resumes_a_one_process_mup_checkpoint(reference):
    """Each stage loads the groups of the parameters it holds, multipliers included."""
    run_dir = resume_from_step_10(reference, "resumed-pp")
    ts.run(ts.torchrun(2, "run", reference["path"], "name=resumed-pp", "mesh.pp=2"), timeout=600)
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(11, 31))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "lr", "eval_loss"])
