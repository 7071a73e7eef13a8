"""Sweep expansion, run ids, the SLURM script and the run command, without running anything
(the real sweep runs in integration_tests/test_sweep.py; reading runs back is llmtrain-ablate's,
tested in packages/ablate/tests)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess

import pytest
import yaml

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop.experiments import sweep_launch, sweep_plan


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


def write_base(tmp_path):
    """A base config the sweep can plan (its data is never read: nothing runs)."""
    path = tmp_path / "base.yaml"
    path.write_text(
        "name: abl\ndevice: cpu\nmodel: {kind: tiny, vocab_size: 320, max_seq_len: 64}\n"
        f"data:\n  train: [{{path: {tmp_path}/none.zarr}}]\n  seq_len: 64\n  micro_batch: 8\n"
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
    shell = (
        f'srun() {{ printf "%s\\n" "$@" > {shlex.quote(str(record))}; }}; '
        "scontrol() { echo node1; }; export -f srun scontrol; "
        f"bash {shlex.quote(str(script))}"
    )
    job = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    env = {**os.environ, **job, "SLURM_NNODES": "1", "SLURM_CPUS_PER_TASK": "16"}
    subprocess.run(["bash", "-c", shell], env=env, check=True, timeout=60, cwd=tmp_path)
    assert record.read_text().splitlines()[:4] == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=16",
        "torchrun",
        "--nnodes=1",
    ]


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
