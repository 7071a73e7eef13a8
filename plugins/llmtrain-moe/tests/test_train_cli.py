"""`llmtrain run` with `model: {kind: moe-tiny}` end to end on CPU, the plugin found through its
entry point: one process learns; 2 gloo ranks under torchrun (FSDP, TP, PP) log the same numbers
as one process with the same micro-batches per rank; `llmtrain eval`, `generate` and `estimate`
take the model too. Each run is a real `python -m llmtrain` subprocess (auxiliary losses on) with
the `moe_router_stats` callback, whose figures of the whole global batch's last micro-batches
are the same at every layout as in one process."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401

RTOL = 1e-4  # float32 sums taken in another order: differences seen are ~3e-7
STEPS = 30
MODEL = {
    "kind": "moe-tiny",
    "max_seq_len": 64,
    "d_model": 32,
    "mlp_hidden": 32,
    "tied_embeddings": False,  # so a pipeline can cut it
    "aux_loss_weight": 0.01,
    "router_z_loss": 0.001,
}
CALLBACKS = [{"kind": "moe_router_stats"}]
ROUTER_KEYS = [
    f"moe/{where}{key}"
    for where in ("layer0/", "layer1/", "")
    for key in ("balance_loss", "max_load", "dropped_share", "z_loss")
]
# The z-loss is continuous in the weights, like the loss. The loads count top-k choices (512 a
# layer in the reference's micro-batch): one choice flipped between layouts by float32 rounding
# would move max_load by 4/512 and the balance loss by far less
ROUTER_RTOL = {"z_loss": RTOL, "balance_loss": 1e-3, "max_load": 2e-2, "dropped_share": 0.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


def _run_one_process(data, tmp, name: str, micro_batch: int) -> dict:
    config = ts.run_config(data, tmp / "runs", name=name)
    config["model"] = dict(MODEL)
    config["data"]["micro_batch"] = micro_batch
    config["training"] = {"steps": STEPS, "log_every": 1}
    config["callbacks"] = CALLBACKS
    path = ts.write_config(tmp / f"{name}.yaml", config)
    proc = ts.run(ts.llmtrain("run", path), timeout=180)
    run_dir = tmp / "runs" / name
    return {"path": path, "proc": proc, "dir": run_dir, "tmp": tmp,
            "metrics": ts.by_step(ts.read_metrics(run_dir))}  # fmt: skip


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """One process, the whole global batch of 8 sequences in one micro-batch."""
    return _run_one_process(data, tmp_path_factory.mktemp("reference"), "ref", 8)


@pytest.fixture(scope="module")
def accumulated(data, tmp_path_factory):
    """One process, 2 micro-batches of 4 sequences per step (what a 2-stage pipeline runs)."""
    return _run_one_process(data, tmp_path_factory.mktemp("accumulated"), "acc", 4)


def test_one_process_learns(reference):
    proc, metrics = reference["proc"], reference["metrics"]
    assert "Traceback" not in proc.stderr
    assert list(metrics) == list(range(1, STEPS + 1))
    assert metrics[1]["loss"] == pytest.approx(math.log(320), rel=0.05)  # starts near uniform
    early = sum(metrics[s]["loss"] for s in range(1, 6)) / 5
    late = sum(metrics[s]["loss"] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert late < early - 1.0, (early, late)
    assert metrics[STEPS]["eval_loss"] < metrics[10]["eval_loss"] < metrics[1]["loss"]
    resolved = (reference["dir"] / "config.yaml").read_text()
    assert "kind: moe-tiny" in resolved and "n_experts: 4" in resolved
    assert "llmtrain-moe" in resolved  # the plugin's version is recorded with the run


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("fsdp", ["data.micro_batch=4"]),  # 4 sequences per rank, one micro-batch each
        ("tp", ["mesh.tp=2"]),  # sequence parallel (the default): experts replicated over tp
    ],
)
def test_two_ranks_log_the_same_numbers_as_one_process(reference, layout, overrides):
    name = f"two-{layout}"
    proc = ts.run(ts.torchrun(2, "run", reference["path"], f"name={name}", *overrides), timeout=180)
    assert ts.error_lines(proc.stderr) == []
    run_dir = reference["tmp"] / "runs" / name
    start = json.loads((run_dir / "logs" / "rank0.jsonl").read_text().splitlines()[0])
    assert start["event"] == "run.start" and start["world"] == 2
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(1, STEPS + 1))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])
    assert got[STEPS]["loss"] < got[1]["loss"] - 1.0
    # FSDP: each rank routes half the batch, and the counts of both make the whole one's
    assert_same_router_stats(reference["metrics"], got)


@pytest.fixture(scope="module")
def expert_parallel(reference):
    """2 ranks, expert parallelism: each holds 2 of the 4 experts of every layer and reads half
    the batch; tokens travel to their experts' rank and back by all-to-all. Saves at step 10."""
    argv = ["name=two-ep", "data.micro_batch=4", "mesh.ep=2", "training.checkpoint_every=10"]
    proc = ts.run(ts.torchrun(2, "run", reference["path"], *argv), timeout=600)
    return {"proc": proc, "dir": reference["tmp"] / "runs" / "two-ep"}


def test_expert_parallel_logs_the_same_numbers_as_one_process(reference, expert_parallel):
    assert ts.error_lines(expert_parallel["proc"].stderr) == []
    got = ts.by_step(ts.read_metrics(expert_parallel["dir"]))
    assert list(got) == list(range(1, STEPS + 1))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])
    assert_same_router_stats(reference["metrics"], got)


@pytest.mark.parametrize(
    ("name", "mesh"),
    [
        # two ranks hold each half of the experts, and FSDP shards that half between them
        ("four-ep", ["mesh.ep=2"]),
        # HSDP: two replicated groups of 2 ranks, each rank one half of the experts whole
        ("four-hsdp-ep", ["mesh.dp_replicate=2", "mesh.ep=2"]),
    ],
)
def test_four_ranks_split_the_experts_and_shard_them(reference, name, mesh):
    """Expert parallelism beside sharded (and replicated) data: the experts' gradients are
    divided by all 4 data ranks whatever their FSDP mesh is."""
    argv = [f"name={name}", "data.micro_batch=2", *mesh]
    proc = ts.run(ts.torchrun(4, "run", reference["path"], *argv), timeout=600)
    assert ts.error_lines(proc.stderr) == []
    got = ts.by_step(ts.read_metrics(reference["tmp"] / "runs" / name))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])


def test_resume_at_another_expert_parallel_degree_continues_exactly(reference, expert_parallel):
    """The ep=2 run's step-10 checkpoint resumed on 4 ranks with ep=4 (one expert a rank): DCP
    reshards the experts, and steps 11-30 are those of the one-process run."""
    run_dir = reference["tmp"] / "runs" / "resharded"
    (run_dir / "checkpoints").mkdir(parents=True)
    step_10 = expert_parallel["dir"] / "checkpoints" / "step-10"
    shutil.copytree(step_10, run_dir / "checkpoints" / "step-10")
    argv = ["name=resharded", "data.micro_batch=2", "mesh.ep=4"]
    proc = ts.run(ts.torchrun(4, "run", reference["path"], *argv), timeout=600)
    assert ts.error_lines(proc.stderr) == []
    assert "run.resumed" in proc.stderr
    got = ts.by_step(ts.read_metrics(run_dir))
    assert list(got) == list(range(11, STEPS + 1))
    ts.assert_close_runs(reference["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])


def test_pipeline_with_expert_parallelism_logs_the_same_numbers(accumulated):
    """4 ranks: a 2-stage pipeline (one layer a stage) whose stages each split their layer's
    experts over 2 data ranks; 2 micro-batches per rank, as in the accumulated run."""
    argv = ["name=pp-ep", "data.micro_batch=2", "mesh.pp=2", "mesh.ep=2"]
    proc = ts.run(ts.torchrun(4, "run", accumulated["path"], *argv), timeout=600)
    assert ts.error_lines(proc.stderr) == []
    got = ts.by_step(ts.read_metrics(accumulated["tmp"] / "runs" / "pp-ep"))
    assert list(got) == list(range(1, STEPS + 1))
    ts.assert_close_runs(accumulated["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])


def test_pipeline_logs_the_same_numbers_as_one_process_with_as_many_micro_batches(accumulated):
    proc = ts.run(
        ts.torchrun(2, "run", accumulated["path"], "name=two-pp", "mesh.pp=2"), timeout=180
    )
    assert ts.error_lines(proc.stderr) == []
    got = ts.by_step(ts.read_metrics(accumulated["tmp"] / "runs" / "two-pp"))
    ts.assert_close_runs(accumulated["metrics"], got, RTOL, ["loss", "grad_norm", "eval_loss"])
    # each stage holds one layer; rank 0's metrics have both, of the last micro-batch
    assert_same_router_stats(accumulated["metrics"], got)


def assert_same_router_stats(expected: dict[int, dict], got: dict[int, dict]) -> None:
    assert list(got) == list(expected)
    for key in ROUTER_KEYS:
        ts.assert_close_runs(expected, got, ROUTER_RTOL[key.rsplit("/", 1)[1]], [key])


def test_router_statistics_are_logged_at_every_step(reference):
    metrics = reference["metrics"]
    for step, line in metrics.items():
        router = {k: v for k, v in line.items() if k.startswith("moe/")}
        assert sorted(router) == sorted(ROUTER_KEYS), step
        for layer in ("layer0/", "layer1/", ""):
            assert router[f"moe/{layer}dropped_share"] == 0.0  # dropless
            assert 1.0 - 1e-6 <= router[f"moe/{layer}balance_loss"] <= 4.0
            assert 1.0 <= router[f"moe/{layer}max_load"] <= 4.0
            assert router[f"moe/{layer}z_loss"] > 0.0
    means = [
        (metrics[s]["moe/layer0/balance_loss"] + metrics[s]["moe/layer1/balance_loss"]) / 2
        for s in metrics
    ]
    assert [metrics[s]["moe/balance_loss"] for s in metrics] == pytest.approx(means, rel=1e-12)


def test_aux_weight_counts_per_micro_batch(reference, accumulated):
    """Documented: the auxiliary losses weigh once per micro-batch, so accumulating 2
    micro-batches doubles them relative to the cross-entropy (a small, visible difference)."""
    a, b = reference["metrics"], accumulated["metrics"]
    assert a[1]["loss"] == pytest.approx(b[1]["loss"], rel=1e-6)  # same weights, same data
    worst = max(abs(a[s]["loss"] - b[s]["loss"]) / a[s]["loss"] for s in a)
    assert 1e-5 < worst < 1e-2, worst


def test_eval_generate_and_estimate_take_the_model(reference, data, run_cli):  # noqa: F811
    checkpoints, metrics = reference["dir"] / "checkpoints", reference["metrics"]
    code, out, err = run_cli(
        "eval", checkpoints, "--data", data.valid, "--batches", 2, "--batch-size", 8
    )
    assert code == 0, err
    assert json.loads(out)["loss"] == pytest.approx(metrics[STEPS]["eval_loss"], rel=1e-5)
    argv = ["generate", checkpoints, "--prompt", "The cat", "--max-new-tokens", 12]
    code, out, err = run_cli(*argv, "--top-k", 1)
    assert code == 0, err
    assert out.startswith("The cat") and len(out.rstrip("\n")) > len("The cat")
    code, out, err = run_cli("estimate", reference["path"], "--world-size", 2, "data.micro_batch=4")
    assert code == 0, err
    assert "parameters" in out and "activations" in out
