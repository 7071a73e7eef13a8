"""A real sweep read back on a machine without torch: `pip install llmtrain-core-mesh
llmtrain-ablate` into a fresh venv (torch not importable there), and `llmtrain compare` and
`llmtrain ranks` print what they print here, with every package installed. `plot` there asks for
the `[plot]` extra instead of failing on an import. The sweep is the README's laptop ablation
(`laptop`, laptop_ladder.py: 2 learning rates x 3 seeds), trained once for the whole session."""

from __future__ import annotations

import pytest
import train_support as ts
from support import ROOT, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(laptop):
    """`llmtrain sweep examples/ablation-laptop.yaml --grid optimizer.lr=1e-3,3e-3 --seeds 3`,
    as the README's laptop commands ran it."""
    work, _ = laptop
    return work / "sweeps" / "lr"


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory):
    """core-mesh and ablate with their declared dependencies, nothing else."""
    env_dir = tmp_path_factory.mktemp("ablate-venv") / "venv"
    run(["uv", "venv", "-q", str(env_dir)])
    python = str(env_dir / "bin" / "python")
    packages = [str(ROOT / "packages" / name) for name in ("core-mesh", "ablate")]
    run(["uv", "pip", "install", "-q", "--python", python, *packages])
    return env_dir


def test_the_light_venv_has_no_torch(light_venv):
    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('matplotlib'))"
    assert run([str(light_venv / "bin" / "python"), "-c", probe]).stdout == "None None\n"


def test_a_sweep_reads_back_the_same_without_torch(sweep, light_venv):
    for run_dir in sorted(p for p in sweep.iterdir() if p.is_dir()):
        written = {"config.yaml", "metrics.jsonl", "summary.json", "logs/rank0.jsonl"}
        assert all((run_dir / name).is_file() for name in written), run_dir
    light = str(light_venv / "bin" / "llmtrain")
    one_run = sweep / "lr=0.003,seed=1"
    for args in (
        ("compare", sweep),
        ("compare", sweep, "--per-run", "--json"),
        ("compare", sweep, "--baseline", "optimizer.lr=0.001", "--json"),  # scipy's tests
        ("compare", *sorted(p for p in sweep.iterdir() if p.is_dir()), "--columns", "all"),
        ("ranks", one_run),
    ):
        here = ts.run(ts.llmtrain(*args), timeout=600).stdout
        there = run([light, *map(str, args)], timeout=600).stdout
        assert there == here, args
    table = run([light, "compare", sweep], timeout=600).stdout.splitlines()
    assert table[0].split()[:4] == ["lr", "runs", "status", "final_eval_loss"]
    rows = [line.split()[:4] for line in table[2:]]
    assert rows == [["0.001", "3", "3", "finished"], ["0.003", "3", "3", "finished"]]


def test_plot_without_matplotlib_names_the_extra(sweep, light_venv, tmp_path):
    light = str(light_venv / "bin" / "llmtrain")
    proc = run([light, "plot", sweep, "-o", tmp_path / "x.png"], check=False, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'llmtrain-ablate[plot]'" in proc.stderr
    assert "Traceback" not in proc.stderr
