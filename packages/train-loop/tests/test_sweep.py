"""Sweep expansion, run ids, the SLURM script and the run command, without running anything
(the real sweep runs in integration_tests/test_sweep.py; reading runs back is llmtrain-ablate's,
tested in packages/ablate/tests)."""

from __future__ import annotations

import pytest

from llmtrain.core_mesh.errors import UserError
from llmtrain.train_loop import sweep


# --- axes and expansion ---
def test_grid_values_are_yaml():
    assert sweep.parse_axis_values("model.n_layers=2,4,8", "--grid") == (
        "model.n_layers",
        [2, 4, 8],
    )
    assert sweep.parse_axis_values("optimizer.lr=3e-4,1e-3", "--grid")[1] == [3e-4, 1e-3]
    _, values = sweep.parse_axis_values("data.weights=[0.2,0.8],[0.5,0.5]", "--grid")
    assert values == [[0.2, 0.8], [0.5, 0.5]]
    assert sweep.parse_axis_values("model.norm='rms',layer", "--grid")[1] == ["rms", "layer"]


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
        sweep.parse_axis_values(text, "--grid")


def test_product_of_grids_then_zip_then_seeds():
    axes = sweep.axes_from(["a=1,2", "b=x,y"], ["c=10,20", "d=p,q"], seeds=2)
    runs = sweep.expand(axes)
    assert len(runs) == 2 * 2 * 2 * 2
    assert runs[0] == {"a": 1, "b": "x", "c": 10, "d": "p", "seed": 0}
    assert runs[1] == {"a": 1, "b": "x", "c": 10, "d": "p", "seed": 1}
    assert runs[2] == {"a": 1, "b": "x", "c": 20, "d": "q", "seed": 0}  # zipped: c and d together
    assert runs[-1] == {"a": 2, "b": "y", "c": 20, "d": "q", "seed": 1}
    assert all((r["c"], r["d"]) in ((10, "p"), (20, "q")) for r in runs)


def test_zip_lengths_must_match():
    with pytest.raises(UserError, match="a has 2, b has 3"):
        sweep.axes_from([], ["a=1,2", "b=1,2,3"], None)


def test_a_zipped_list_may_repeat_a_value_but_not_a_row():
    runs = sweep.expand(sweep.axes_from([], ["d=32,64,64", "n=1,1,2"], None))
    assert runs == [{"d": 32, "n": 1}, {"d": 64, "n": 1}, {"d": 64, "n": 2}]
    with pytest.raises(UserError, match="two zipped rows are the same run"):
        sweep.axes_from([], ["d=32,64,64", "n=1,2,2"], None)


def test_a_key_is_swept_once():
    with pytest.raises(UserError, match="a is swept twice"):
        sweep.axes_from(["a=1,2"], ["a=3,4"], None)
    with pytest.raises(UserError, match="seed is swept twice"):
        sweep.axes_from(["seed=1,2"], [], 3)
    with pytest.raises(UserError, match="at least 1"):
        sweep.axes_from([], [], 0)


def test_run_ids_are_short_readable_and_unique():
    settings = sweep.expand(sweep.axes_from(["model.n_layers=2,4", "optimizer.lr=3e-4"], [], 2))
    assert sweep.run_ids(settings) == [
        "n_layers=2,lr=0.0003,seed=0",
        "n_layers=2,lr=0.0003,seed=1",
        "n_layers=4,lr=0.0003,seed=0",
        "n_layers=4,lr=0.0003,seed=1",
    ]
    clash = [{"optimizer.lr": 0.1234567}, {"optimizer.lr": 0.12345671}]  # same when shown
    ids = sweep.run_ids(clash)
    assert len(set(ids)) == 2 and all(i.startswith("lr=0.123457-") for i in ids)
    long = [{"model.name": "x" * 300}]
    assert len(sweep.run_ids(long)[0]) <= sweep.MAX_ID
    assert sweep.run_ids([{}]) == ["base"]
    weights = sweep.run_ids([{"data.weights": [0.2, 0.8]}, {"data.weights": [1, 0]}])
    assert weights == ["weights=0.2-0.8", "weights=1-0"]


def test_slurm_script_array_and_options(tmp_path):
    configs = [tmp_path / f"r{i}" / "config.yaml" for i in range(5)]
    text = sweep.slurm_script(
        "abl",
        configs,
        nodes=2,
        nproc=8,
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
    assert sweep.run_command(cfg, 1, executable=False) == [
        "llmtrain",
        "run",
        str(cfg),
        "--resume",
    ]
    printed = sweep.run_command(cfg, 4, executable=False)
    assert printed[:3] == ["torchrun", "--standalone", "--nproc-per-node=4"]
    here = sweep.run_command(cfg, 2, executable=True)
    assert here[1:3] == ["-m", "torch.distributed.run"] and here[-3:] == [
        "run",
        str(cfg),
        "--resume",
    ]
