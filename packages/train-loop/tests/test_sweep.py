"""Sweep expansion, run ids, the SLURM script and the run command, data mixtures drawn by
`--mixtures`, without running anything (the real sweep runs in integration_tests/test_sweep.py;
reading runs back is llmtrain-ablate's, tested in packages/ablate/tests)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess

import numpy as np
import pytest
import yaml

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.experiments import sweep_launch, sweep_plan
from llmtrain.train_loop.experiments.mixtures import DECIMALS, draw, mixtures_from, rounded
from llmtrain.train_loop.run_config import DataConfig, DatasetRef


# --- axes and expansion ---
def test_grid_values_are_yaml():
    assert sweep_plan.parse_axis_values("model.n_layers=2,4,8", "--grid") == (
        "model.n_layers",
        [2, 4, 8],
    )
    assert sweep_plan.parse_axis_values("optimizer.lr=3e-4,1e-3", "--grid")[1] == [3e-4, 1e-3]
    _, values = sweep_plan.parse_axis_values("data.weights=[0.2,0.8],[0.5,0.5]", "--grid")
    assert values == [[0.2, 0.8], [0.5, 0.5]]
    assert sweep_plan.parse_axis_values("model.norm='rms',layer", "--grid")[1] == ["rms", "layer"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model.n_layers", "key.path=value1,value2"),
        ("model.n_layers=", "key.path=value1,value2"),
        ("model..n=1", "empty key"),
        ("model.n_layers=2,2", "given twice"),
        ("model.n_layers=[2,", "not a YAML list"),
    ],
)
def test_bad_grid_text(text, message):
    with pytest.raises(UserError, match=message):
        sweep_plan.parse_axis_values(text, "--grid")


def test_product_of_grids_then_zip_then_seeds():
    axes = sweep_plan.axes_from(["a=1,2", "b=x,y"], ["c=10,20", "d=p,q"], seeds=2)
    runs = sweep_plan.expand(axes)
    assert len(runs) == 2 * 2 * 2 * 2
    assert runs[0] == {"a": 1, "b": "x", "c": 10, "d": "p", "seed": 0}
    assert runs[1] == {"a": 1, "b": "x", "c": 10, "d": "p", "seed": 1}
    assert runs[2] == {"a": 1, "b": "x", "c": 20, "d": "q", "seed": 0}  # zipped: c and d together
    assert runs[-1] == {"a": 2, "b": "y", "c": 20, "d": "q", "seed": 1}
    assert all((r["c"], r["d"]) in ((10, "p"), (20, "q")) for r in runs)


def test_zip_lengths_must_match():
    with pytest.raises(UserError, match="a has 2, b has 3"):
        sweep_plan.axes_from([], ["a=1,2", "b=1,2,3"], None)


def test_a_zipped_list_may_repeat_a_value_but_not_a_row():
    runs = sweep_plan.expand(sweep_plan.axes_from([], ["d=32,64,64", "n=1,1,2"], None))
    assert runs == [{"d": 32, "n": 1}, {"d": 64, "n": 1}, {"d": 64, "n": 2}]
    with pytest.raises(UserError, match="two zipped rows are the same run"):
        sweep_plan.axes_from([], ["d=32,64,64", "n=1,2,2"], None)


def test_a_key_is_swept_once():
    with pytest.raises(UserError, match="a is swept twice"):
        sweep_plan.axes_from(["a=1,2"], ["a=3,4"], None)
    with pytest.raises(UserError, match="seed is swept twice"):
        sweep_plan.axes_from(["seed=1,2"], [], 3)
    with pytest.raises(UserError, match="at least 1"):
        sweep_plan.axes_from([], [], 0)


def test_run_ids_are_short_readable_and_unique():
    settings = sweep_plan.expand(
        sweep_plan.axes_from(["model.n_layers=2,4", "optimizer.lr=3e-4"], [], 2)
    )
    assert sweep_plan.run_ids(settings) == [
        "n_layers=2,lr=0.0003,seed=0",
        "n_layers=2,lr=0.0003,seed=1",
        "n_layers=4,lr=0.0003,seed=0",
        "n_layers=4,lr=0.0003,seed=1",
    ]
    clash = [{"optimizer.lr": 0.1234567}, {"optimizer.lr": 0.12345671}]  # same when shown
    ids = sweep_plan.run_ids(clash)
    assert len(set(ids)) == 2 and all(i.startswith("lr=0.123457-") for i in ids)
    long = [{"model.name": "x" * 300}]
    assert len(sweep_plan.run_ids(long)[0]) <= sweep_plan.MAX_ID
    assert sweep_plan.run_ids([{}]) == ["base"]
    weights = sweep_plan.run_ids([{"data.weights": [0.2, 0.8]}, {"data.weights": [1, 0]}])
    assert weights == ["weights=0.2-0.8", "weights=1-0"]


def test_slurm_script_array_and_options(tmp_path):
    configs = [tmp_path / f"r{i}" / "config.yaml" for i in range(5)]
    text = sweep_launch.slurm_script(
        "abl",
        configs,
        nodes=2,
        nproc=8,
        gpus_per_node=8,
        options=["partition=gpu", "--time=01:00:00", "exclusive"],
        max_parallel=3,
        sweep_dir=tmp_path,
    )
    assert "#SBATCH --array=0-4%3\n" in text
    assert "#SBATCH --nodes=2\n" in text
    assert "#SBATCH --partition=gpu\n" in text
    assert "#SBATCH --time=01:00:00\n" in text
    assert "#SBATCH --exclusive\n" in text
    assert "--nproc-per-node=8" in text
    listed = text.split("CONFIGS=(\n")[1].split("\n)")[0].split("\n")
    assert [line.strip() for line in listed] == [str(c) for c in configs]


def test_run_command_here_and_printed(tmp_path):
    cfg = tmp_path / "c.yaml"
    assert sweep_launch.run_command(cfg, 1, executable=False) == [
        "llmtrain",
        "run",
        str(cfg),
        "--resume",
    ]
    printed = sweep_launch.run_command(cfg, 4, executable=False)
    assert printed[:3] == ["torchrun", "--standalone", "--nproc-per-node=4"]
    here = sweep_launch.run_command(cfg, 2, executable=True)
    assert here[1:3] == ["-m", "torch.distributed.run"] and here[-3:] == [
        "run",
        str(cfg),
        "--resume",
    ]


# --- the command: overrides of the base, what a SLURM task asks for ---


def write_base(tmp_path, datasets=("none",), data=""):
    """A base config the sweep can plan over `datasets` (never read: nothing runs); `data`: more
    lines of its `data:` section."""
    train = ", ".join(f"{{path: {tmp_path}/{name}.zarr}}" for name in datasets)
    path = tmp_path / "base.yaml"
    path.write_text(
        "name: abl\ndevice: cpu\nmodel: {kind: tiny, vocab_size: 320, max_seq_len: 64}\n"
        f"data:\n  train: [{train}]\n  seq_len: 64\n  micro_batch: 8\n{data}"
        "optimizer: {kind: adamw, lr: 3.0e-3}\ntraining: {steps: 10}\n",
        encoding="utf-8",
    )
    return path


def written(sweeps, run_id) -> dict:
    return yaml.safe_load((sweeps / "abl" / run_id / "config.yaml").read_text())


def test_overrides_change_the_base_before_the_axes(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path), tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, "data.global_batch=64", "--grid", "model.n_layers=1,2",
        "optimizer.lr=0.01", "--launch", "print", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err
    assert len(out.splitlines()) == 2  # one printed command per run
    for n_layers in (1, 2):
        config = written(sweeps, f"n_layers={n_layers}")
        assert config["model"]["n_layers"] == n_layers
        assert (config["data"]["global_batch"], config["data"]["micro_batch"]) == (64, 8)
        assert config["optimizer"]["lr"] == 0.01
    manifest = json.loads((sweeps / "abl" / "manifest.json").read_text())
    assert manifest["overrides"] == ["data.global_batch=64", "optimizer.lr=0.01"]
    command = shlex.split(manifest["command"])
    assert command[2:5] == [str(base), "data.global_batch=64", "optimizer.lr=0.01"]
    # the base's name is overridden like any key: it names the sweep
    code, _, err = run_cli("sweep", base, "name=other", "--dry-run", "--dir", sweeps)
    assert code == 0 and "sweep other: 1 runs" in err, err


def test_overrides_size_a_ladder(installed, tmp_path, run_cli):
    base = write_base(tmp_path)
    code, out, err = run_cli(
        "sweep", base, "data.micro_batch=16", "--ladder", "--budgets", "1e13",
        "--tokens-per-param", "20", "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    row = out.strip().splitlines()[1].split()
    tokens, steps = int(row[4].replace(",", "")), int(row[-1])
    assert steps == math.ceil(tokens / (16 * 64))  # 16 sequences of 64 tokens per step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.globl_batch=64"], "override 'data.globl_batch=64': data.globl_batch: unknown"),
        (["data.global_batch=sixty"], "override 'data.global_batch=sixty'"),
        (
            ["model.n_layers=3", "--grid", "model.n_layers=1,2"],
            "'model.n_layers=3' sets a key that --grid 'model.n_layers=1,2' sweeps",
        ),
        (  # data.weights sets each dataset's weight
            ["data.train.0.weight=0.5", "--grid", "data.weights=[1],[2]"],
            "'data.train.0.weight=0.5' sets a key that --grid 'data.weights=[1],[2]' sweeps",
        ),
    ],
)
def test_bad_overrides_are_refused_before_anything_is_written(
    installed, tmp_path, run_cli, args, message
):
    base, sweeps = write_base(tmp_path), tmp_path / "sweeps"
    code, _, err = run_cli("sweep", base, *args, "--dir", sweeps)
    assert code == 2 and message in err, err
    assert not sweeps.exists()


def slurm_text(tmp_path, *, nproc=4, gpus_per_node=4, options=()) -> str:
    return sweep_launch.slurm_script(
        "abl",
        [tmp_path / "r0" / "config.yaml"],
        nodes=1,
        nproc=nproc,
        gpus_per_node=gpus_per_node,
        options=list(options),
        max_parallel=None,
        sweep_dir=tmp_path,
    )


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_a_slurm_task_asks_for_the_gpus_and_cpus_of_its_processes(tmp_path):
    lines = sbatch_lines(slurm_text(tmp_path))
    assert "#SBATCH --ntasks-per-node=1" in lines  # torchrun starts the node's processes
    assert "#SBATCH --gpus-per-node=4" in lines
    assert f"#SBATCH --cpus-per-task={4 * sweep_launch.CPUS_PER_PROCESS}" in lines
    # a CPU job asks for no GPU
    lines = sbatch_lines(slurm_text(tmp_path, gpus_per_node=0))
    assert not [line for line in lines if line.startswith(("#SBATCH --gpus", "#SBATCH --gres"))]
    assert f"#SBATCH --cpus-per-task={4 * sweep_launch.CPUS_PER_PROCESS}" in lines
    # --slurm options that ask for GPUs or CPUs their own way replace the script's
    lines = sbatch_lines(slurm_text(tmp_path, options=["gres=gpu:a100:4", "cpus-per-task=32"]))
    assert [line for line in lines if "gpu" in line or "cpus" in line] == [
        "#SBATCH --gres=gpu:a100:4",
        "#SBATCH --cpus-per-task=32",
    ]


def test_srun_passes_the_cpus_on_to_torchrun(tmp_path):
    """The script under shell functions standing in for srun and scontrol: srun is given the
    job's cpus-per-task (Slurm 22.05 and later do not pass it on by themselves)."""
    script, record = tmp_path / "sweep.sbatch", tmp_path / "srun.args"
    script.write_text(slurm_text(tmp_path))
    (tmp_path / "r0").mkdir()  # the run's directory, where its output.log goes
    shell = (
        f'srun() {{ printf "%s\\n" "$@" > {shlex.quote(str(record))}; }}; '
        "scontrol() { echo node1; }; export -f srun scontrol; "
        f"bash {shlex.quote(str(script))}"
    )
    job = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "7", "SLURM_JOB_ID": "7"}
    job["SLURM_JOB_NODELIST"] = "node1"
    env = {**os.environ, **job, "SLURM_NNODES": "1", "SLURM_CPUS_PER_TASK": "16"}
    subprocess.run(["bash", "-c", shell], env=env, check=True, timeout=60, cwd=tmp_path)
    assert record.read_text().splitlines()[:4] == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=16",
        "torchrun",
        "--nnodes=1",
    ]
    # the run's output.log has the script's note of the attempt
    assert "slurm 7_0: attempt 1 on node1: " in (tmp_path / "r0" / "output.log").read_text()


def test_failure_is_a_failed_summary_or_the_job_scripts_exit_note(tmp_path):
    """Why a run failed, as `llmtrain sweep` reports it: summary.json's error, else (a run that
    failed under the job script before it wrote one) the script's exit-code note, with the
    run's last error line; None while it is not known to have failed."""
    run = tmp_path / "run"
    run.mkdir()
    assert sweep_launch.failure(run) is None  # never ran
    log = run / "output.log"
    log.write_text(
        "# 2026-01-01 00:00:00 slurm 7_0: attempt 1 on node1: run/config.yaml\n"
        "error: data.zarr: not a packed dataset\n"
        "srun: error: node1: task 0: Exited with exit code 1\n"
        "# 2026-01-01 00:00:09 slurm 7_0: exit code 1\n"
    )
    assert sweep_launch.failure(run) == "exit code 1: data.zarr: not a packed dataset"
    with log.open("a") as out:  # submitted again: running, not failed
        out.write("# 2026-01-01 00:01:00 slurm 8_0: attempt 1 on node1: run/config.yaml\n")
    assert sweep_launch.failure(run) is None
    summary = {"status": "failed", "step": 3, "error": "the loss is nan"}
    (run / "summary.json").write_text(json.dumps(summary))
    assert sweep_launch.failure(run) == "the loss is nan"
    (run / "summary.json").write_text(json.dumps({**summary, "exit_code": 1}))  # a run here
    assert sweep_launch.failure(run) == "exit code 1: the loss is nan"
    (run / "summary.json").write_text(json.dumps({"status": "stopped", "step": 3}))
    assert sweep_launch.failure(run) is None


def test_the_gpus_a_sweep_asks_for_on_the_command_line(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path), tmp_path / "sweeps"
    launch = ("--launch", "slurm", "--nproc-per-node", "4", "--dir", sweeps)
    code, _, err = run_cli("sweep", base, "--grid", "seed=1,2", *launch)
    assert code == 0, err
    lines = sbatch_lines((sweeps / "abl" / "sweep.sbatch").read_text())
    assert "#SBATCH --gpus-per-node=4" in lines
    code, _, err = run_cli("sweep", base, "--grid", "seed=1,2", *launch, "--gpus-per-node", "0")
    assert code == 0, err
    lines = sbatch_lines((sweeps / "abl" / "sweep.sbatch").read_text())
    assert not [line for line in lines if line.startswith(("#SBATCH --gpus", "#SBATCH --gres"))]
    code, _, err = run_cli("sweep", base, "--gpus-per-node", "2", "--dir", sweeps)
    assert code == 2 and "--gpus-per-node is for --launch slurm" in err


# --- --mixtures: the Dirichlet draw (reproducible, by the numbers, rounded into valid weights),
# the mixtures as an axis crossed with the others, what the manifest keeps, the refusals ---

DATASETS = ("web", "code", "books")


def weights_of(sweeps, run_id) -> list[float]:
    return [entry["weight"] for entry in written(sweeps, run_id)["data"]["train"]]


def draws(n, alphas, seed=0) -> np.ndarray:
    return np.array([draw(k, alphas, seed) for k in range(n)])


def test_a_mixture_depends_on_the_seed_alpha_and_its_index_only(tmp_path):
    base = write_base(tmp_path, DATASETS)

    def weights(n, alpha=None, seed=None):
        mixtures = mixtures_from(n, alpha, seed, base=str(base), overrides=(), axes=())
        assert mixtures is not None
        return mixtures.weights

    assert weights(8) == weights(8) == weights(8, "1", 0)  # the defaults: alpha 1, seed 0
    assert weights(8, seed=1) != weights(8)
    assert weights(8, alpha="0.3") != weights(8)
    # mixture k does not depend on N: a swarm grown from 16 to 32 keeps its first 16
    assert weights(32)[:16] == weights(16)
    assert len({json.dumps(w) for w in weights(32)}) == 32
    assert weights(4) == [draw(k, [1.0] * 3, 0) for k in range(4)]


def test_the_draws_follow_the_dirichlet_distribution():
    """Dirichlet(alpha, k = 4): each weight's mean is 1/k, its variance
    alpha (a0 - alpha) / (a0^2 (a0 + 1)) with a0 = k alpha; alpha 1 is uniform over the simplex
    (the largest weight's mean is (1/k)(1 + 1/2 + ... + 1/k)); a small alpha puts most of the
    weight on one dataset, a large one spreads it evenly. 4000 draws: a standard error of
    about 0.003 on the means."""
    k = 4
    for alpha in (0.05, 1.0, 100.0):
        w = draws(4000, [alpha] * k)
        a0 = k * alpha
        variance = alpha * (a0 - alpha) / (a0**2 * (a0 + 1))
        assert np.allclose(w.mean(axis=0), 1 / k, atol=0.015), (alpha, w.mean(axis=0))
        assert np.allclose(w.var(axis=0), variance, rtol=0.1), (alpha, w.var(axis=0), variance)
        largest = w.max(axis=1)
        if alpha == 1.0:
            assert largest.mean() == pytest.approx(
                sum(1 / i for i in range(1, k + 1)) / k, abs=0.01
            )
            assert (largest > 0.9).mean() < 0.01
        if alpha == 0.05:
            assert largest.mean() > 0.88
            assert (largest > 0.9).mean() > 0.65  # most runs are nearly one dataset
            assert (w == 0).mean() > 0.4  # many datasets switched off
        if alpha == 100.0:
            assert largest.max() < 0.4
    # one alpha per dataset: means alpha_i / a0
    w = draws(4000, [1.0, 3.0])
    assert np.allclose(w.mean(axis=0), [0.25, 0.75], atol=0.01)


def test_rounding_never_yields_an_invalid_weight():
    """Multiples of 1e-4 that sum to 1, each within 1e-4 of the draw, at least one positive,
    every positive one at least 1e-4: what run_config's DataConfig accepts (no positive weight
    below MIN_WEIGHT of the total)."""
    rng = np.random.default_rng(0)
    cases = [
        [1e-9, 1 - 1e-9],
        [0.00005, 0.99995],
        [0.5, 0.5],
        [1 / 3] * 3,
        [1 / 300] * 300,
        [1 / 20001] * 20001,  # every weight below 1e-4: the leftover units still sum to 1
        *(rng.dirichlet([alpha] * k) for alpha in (0.001, 0.01, 1.0) for k in (2, 5, 60)),
        *(list(row) for row in draws(200, [0.02] * 8)),
    ]
    for weights in cases:
        got = rounded(weights)
        units = [round(w * 10**DECIMALS) for w in got]
        assert all(math.isclose(u, w * 10**DECIMALS) for u, w in zip(units, got, strict=True))
        assert sum(units) == 10**DECIMALS
        assert all(u >= 0 for u in units) and any(units)
        assert max(abs(r - w) for r, w in zip(got, weights, strict=True)) <= 10**-DECIMALS
        if len(got) <= 300:
            DataConfig(train=[DatasetRef(path="d", weight=w) for w in got], seq_len=8)


def test_dry_run_lists_every_runs_weights(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path, DATASETS), tmp_path / "sweeps"
    code, out, err = run_cli("sweep", base, "--mixtures", "3", "--seeds", "2", "--dry-run")
    assert code == 0, err
    assert "sweep abl: 6 runs" in err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["run", "id", *DATASETS]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == [f"mix={k:03d},seed={s}" for k in range(3) for s in (0, 1)]
    for row in rows:
        assert [float(w) for w in row[1:]] == draw(int(row[0][4:7]), [1.0] * 3, 0)
    assert not sweeps.exists()


def test_the_manifest_records_the_draw(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path, DATASETS), tmp_path / "sweeps"
    flags = ("--mixtures", "4", "--alpha", "0.5,1,2", "--mixture-seed", "7")
    code, out, err = run_cli("sweep", base, *flags, "--launch", "print", "--dir", sweeps)
    assert code == 0, err
    assert len(out.splitlines()) == 4
    manifest = json.loads((sweeps / "abl" / "manifest.json").read_text())
    assert manifest["mixtures"] == {
        "n": 4,
        "alpha": [0.5, 1.0, 2.0],
        "seed": 7,
        "datasets": [f"{tmp_path}/{name}.zarr" for name in DATASETS],
        "numpy": np.__version__,
    }
    assert shlex.split(manifest["command"])[3:9] == list(flags)
    expected = [draw(k, [0.5, 1.0, 2.0], 7) for k in range(4)]
    assert manifest["axes"] == [{"keys": ["data.weights"], "values": [[w] for w in expected]}]
    assert manifest["varied"] == ["data.weights"]
    for k, (entry, weights) in enumerate(zip(manifest["runs"], expected, strict=True)):
        assert entry == {"id": f"mix={k:03d}", "settings": {"data.weights": weights}}
        assert weights_of(sweeps, entry["id"]) == weights
    # another draw under the same ids is another sweep
    code, _, err = run_cli("sweep", base, "--mixtures", "2", "--launch", "print", "--dir", sweeps)
    assert code == 2 and "already has runs with other configs: mix=000" in err, err
    # one alpha for every dataset is recorded as the number
    launch = ("--launch", "print", "--dir", sweeps, "--name", "even")
    code, _, err = run_cli("sweep", base, "--mixtures", "2", "--alpha", "2", *launch)
    manifest = json.loads((sweeps / "even" / "manifest.json").read_text())
    assert code == 0 and manifest["mixtures"]["alpha"] == 2.0, err


def test_mixtures_cross_the_other_axes_and_pair_by_seed(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path, DATASETS), tmp_path / "sweeps"
    code, _, err = run_cli(
        "sweep", base, "--mixtures", "3", "--seeds", "2", "--launch", "print", "--dir", sweeps
    )
    assert code == 0, err
    runs = json.loads((sweeps / "abl" / "manifest.json").read_text())["runs"]
    assert len(runs) == 3 * 2
    for k in range(3):
        pair = [f"mix={k:03d},seed={seed}" for seed in (0, 1)]
        assert weights_of(sweeps, pair[0]) == weights_of(sweeps, pair[1]) == draw(k, [1.0] * 3, 0)
        assert [written(sweeps, run_id)["seed"] for run_id in pair] == [0, 1]
    code, out, err = run_cli(
        "sweep", base, "--mixtures", "2", "--grid", "optimizer.lr=1e-3,3e-3",
        "--zip", "model.n_layers=1,2", "--zip", "model.d_model=32,64", "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    ids = [line.split()[0] for line in out.strip().splitlines()[2:]]
    assert len(ids) == 2 * 2 * 2
    assert ids[:3] == [
        "mix=000,lr=0.001,n_layers=1,d_model=32",
        "mix=000,lr=0.001,n_layers=2,d_model=64",
        "mix=000,lr=0.003,n_layers=1,d_model=32",
    ]
    code, out, err = run_cli(
        "sweep", base, "--mixtures", "2", "--ladder", "--budgets", "1e13",
        "--tokens-per-param", "10,20", "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    assert "C=1e13,r=10,mix=001" in out.split()


def test_a_grown_swarm_keeps_its_first_runs(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path, DATASETS), tmp_path / "sweeps"
    launch = ("--launch", "print", "--dir", sweeps)
    assert run_cli("sweep", base, "--mixtures", "3", *launch)[0] == 0
    before = {k: weights_of(sweeps, f"mix={k:03d}") for k in range(3)}
    code, out, err = run_cli("sweep", base, "--mixtures", "5", *launch)
    assert code == 0, err  # the first three configs are the same: no clash
    assert len(out.splitlines()) == 5
    assert {k: weights_of(sweeps, f"mix={k:03d}") for k in range(3)} == before
    manifest = json.loads((sweeps / "abl" / "manifest.json").read_text())
    assert [run["id"] for run in manifest["runs"]] == [f"mix={k:03d}" for k in range(5)]
    assert manifest["mixtures"]["n"] == 5


def test_a_slurm_array_over_the_mixtures(installed, tmp_path, run_cli):
    base, sweeps = write_base(tmp_path, DATASETS), tmp_path / "sweeps"
    code, out, err = run_cli(
        "sweep", base, "--mixtures", "4", "--seeds", "2", "--launch", "slurm",
        "--max-parallel", "3", "--dir", sweeps,
    )  # fmt: skip
    assert code == 0, err
    script = (sweeps / "abl" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-7%3\n" in script
    listed = script.split("CONFIGS=(\n")[1].split("\n)")[0].split("\n")
    assert [line.strip() for line in listed] == [
        str(sweeps / "abl" / f"mix={k:03d},seed={s}" / "config.yaml")
        for k in range(4)
        for s in (0, 1)
    ]
    assert out.startswith("sbatch ")


@pytest.mark.parametrize(
    ("args", "base_data", "message"),
    [
        (["--mixtures", "0"], {}, "--mixtures must be at least 1, got 0"),
        (["--mixtures", "-3"], {}, "--mixtures must be at least 1, got -3"),
        (["--mixtures", "4", "--alpha", "0"], {}, "--alpha 0: give a positive number"),
        (["--mixtures", "4", "--alpha", "-1"], {}, "--alpha -1: give a positive number"),
        (["--mixtures", "4", "--alpha", "abc"], {}, "--alpha abc: give a positive number"),
        (["--mixtures", "4", "--alpha", "nan"], {}, "--alpha nan: give a positive number"),
        (["--mixtures", "4", "--alpha", "1,,2"], {}, "--alpha 1,,2: give a positive number"),
        (
            ["--mixtures", "4", "--alpha", "1,2"],
            {},
            "--alpha 1,2: 2 values for the 3 datasets of data.train; give one, or one per dataset",
        ),
        (["--mixtures", "4", "--mixture-seed", "-1"], {}, "--mixture-seed must be 0 or more"),
        (["--alpha", "0.5"], {}, "--alpha draw data mixtures: add --mixtures N"),
        (
            ["--alpha", "0.5", "--mixture-seed", "1"],
            {},
            "--alpha, --mixture-seed draw data mixtures: add --mixtures N",
        ),
        (
            ["--mixtures", "4", "--grid", "data.weights=[1,1,0],[0,1,1]"],
            {},
            "--grid 'data.weights=[1,1,0],[0,1,1]' and --mixtures 4 both set the weights",
        ),
        (
            ["--mixtures", "4", "--zip", "data.weights=[1,1,0],[0,1,1]", "--zip", "seed=1,2"],
            {},
            "--zip 'data.weights=[1,1,0],[0,1,1]' and --mixtures 4 both set the weights",
        ),
        (
            ["--mixtures", "4", "--grid", "data.train.0.weight=0.5,1"],
            {},
            "--grid 'data.train.0.weight=0.5,1' and --mixtures 4 both set the weights",
        ),
        (
            ["--mixtures", "4", "data.weights=[1,1,1]"],
            {},
            "'data.weights=[1,1,1]' sets a key that --mixtures 4 sweeps",
        ),
        (
            ["--mixtures", "4", "data.train.1.weight=0.5"],
            {},
            "'data.train.1.weight=0.5' sets a key that --mixtures 4 sweeps",
        ),
        (
            ["--mixtures", "4"],
            {"datasets": ("web",)},
            "a mixture needs at least two datasets in data.train, the base has 1",
        ),
        (
            ["--mixtures", "4"],
            {"data": "  phases: [{weights: [1, 0, 0], until_step: 5}, {weights: [0, 1, 1]}]\n"},
            "phases carry their own weights; --mixtures draws one mixture per run",
        ),
        (
            ["--mixtures", "4", "data.phases=[{weights: [1, 0, 0]}]"],
            {},
            "phases carry their own weights; --mixtures draws one mixture per run",
        ),
    ],
)
def test_bad_mixture_inputs_are_one_line(installed, tmp_path, run_cli, args, base_data, message):
    base, sweeps = write_base(tmp_path, **{"datasets": DATASETS, **base_data}), tmp_path / "sweeps"
    code, _, err = run_cli("sweep", base, *args, "--launch", "print", "--dir", sweeps)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not sweeps.exists()


def test_the_time_left_counts_the_steps_still_to_train():
    from types import SimpleNamespace

    from llmtrain.train_loop.experiments.sweep_launch import TimeLeft

    def run(run_id: str, steps: int, start: int | None = None) -> SimpleNamespace:
        init = None if start is None else SimpleNamespace(state="all", step=start)
        return SimpleNamespace(
            id=run_id, config=SimpleNamespace(training=SimpleNamespace(steps=steps), init=init)
        )

    # a trunk of 100 steps, a branch of 40 from step 30 (10 to train), a run of 160
    trunk, branch, long = run("a", 100), run("b", 40, start=30), run("c", 160)
    clock = TimeLeft([trunk, branch, long])
    # 100 steps in 50 s: 0.5 s a step, 170 steps to go
    assert clock.done(trunk, 50.0) == "; 2 runs to go, about 85 s left"
    # 110 steps in 66 s: 0.6 s a step, 160 steps: 96 s
    assert clock.done(branch, 16.0) == "; 1 run to go, about 2 min left"
    assert clock.done(long, 200.0) == ""
