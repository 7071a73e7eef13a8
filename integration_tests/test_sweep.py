"""`llmtrain sweep`, `compare` and `plot` end to end on CPU: a real 4-run sweep trains every run
from its own config (each repeatable alone), compare's means and stds are the runs' numbers, a
restarted sweep skips what finished and resumes a run killed mid-way to the same losses, failed
runs are reported while the rest go on, bad axes are refused before anything is written, and
the SLURM job array covers the unfinished runs. Sweeps and runs are real `python -m llmtrain`
subprocesses; the sweeps are shared by the tests through module-scoped fixtures."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import train_support as ts
import yaml

STEPS = 12  # per run: eval and a checkpoint at steps 6 and 12, ~2 s with the process start
TOKENS = STEPS * 8 * 32  # global batch 8 of seq_len 32
RTOL = 1e-6
KEYS = ("loss", "lr", "grad_norm", "eval_loss", "tokens")
IDS = ["n_layers=1,seed=0", "n_layers=1,seed=1", "n_layers=2,seed=0", "n_layers=2,seed=1"]
# the `failed` sweep's axes: no list repeats a value (--zip refuses one given twice)
FAILED_AXES = ("--zip", "optimizer.lr=1e-3,1e9,2e-3", "--zip", "data.seq_len=32,16,100")


def small_config(data: SimpleNamespace, name: str, *, steps: int = STEPS) -> dict:
    """The shared run config cut to `steps` steps, eval and checkpoint every 6."""
    config = ts.run_config(data, data.dir / "unused", name)  # the sweep sets run_dir
    config["data"]["eval"]["every"] = 6
    config["training"].update(steps=steps, log_every=1, checkpoint_every=6)
    return config


def sweep_cmd(base: Path, sweeps: Path, *args: object) -> list[str]:
    return ts.llmtrain("sweep", base, *args, "--dir", sweeps)


def metrics_of(run_dir: Path) -> dict[int, dict]:
    return ts.by_step(ts.read_metrics(run_dir))


def final_eval_loss(run_dir: Path) -> float:
    return [m["eval_loss"] for m in ts.read_metrics(run_dir) if "eval_loss" in m][-1]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def config_of(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def slurm_configs(script: Path) -> list[str]:
    """The CONFIGS array of a job script, as bash reads it."""
    shell = f'source <(sed -n "/^CONFIGS=(/,/^)/p" {shlex.quote(str(script))}); '
    shell += 'printf "%s\\n" "${CONFIGS[@]}"'
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def refused(cmd: list[str]) -> str:
    proc = ts.run(cmd, check=False, timeout=600)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ts.error_lines(proc.stderr), proc.stderr
    return proc.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ts.pack_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def bases(data, tmp_path_factory):
    """Base configs: `small` (12 steps), `long` (60 steps: a kill lands mid-run), `big` (a
    global batch of 64, which 2 nodes x 8 ranks x micro-batch 4 divide), and `mix` (two
    datasets: the train and the valid corpus, with seed 0 and 2 layers like run
    `n_layers=2,seed=0` of the 4-run sweep)."""
    tmp = tmp_path_factory.mktemp("bases")
    big = small_config(data, "big")
    big["data"]["global_batch"] = 64
    mix = small_config(data, "mix")
    mix["seed"] = 0
    mix["model"]["n_layers"] = 2
    mix["data"]["train"] = [{"path": data.train}, {"path": data.valid}]
    configs = {
        "small": small_config(data, "abl"),
        "long": small_config(data, "long", steps=60),
        "big": big,
        "mix": mix,
    }
    return SimpleNamespace(
        **{name: ts.write_config(tmp / f"{name}.yaml", c) for name, c in configs.items()}
    )


@pytest.fixture(scope="module")
def swept(bases, tmp_path_factory) -> SimpleNamespace:
    """The module's three sweeps (`sweep`, `failed`, `mix`), started together: a sweep runs its
    runs one after another and each run's start is seconds of imports on one core, so side by
    side they keep the machine's cores busy. By name: `commands`, `done` (CompletedProcesses)
    and `dirs` (their --dir)."""
    sweeps = {name: tmp_path_factory.mktemp(name) / "sweeps" for name in ("sweep", "failed", "mix")}
    commands = {
        "sweep": sweep_cmd(
            bases.small, sweeps["sweep"], "--grid", "model.n_layers=1,2", "--seeds", 2
        ),
        "failed": sweep_cmd(bases.small, sweeps["failed"], *FAILED_AXES, "--name", "f"),
        "mix": sweep_cmd(bases.mix, sweeps["mix"], "--grid", "data.weights=[1,0],[0,1]"),
    }
    procs = {name: ts.start(cmd) for name, cmd in commands.items()}
    done = {}
    try:
        done = {name: ts.finish(proc, timeout=600) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                ts.stop_group(proc)
                proc.communicate()
    for name in ("sweep", "mix"):  # the failed sweep exits 1
        proc = done[name]
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return SimpleNamespace(commands=commands, done=done, dirs=sweeps)


@pytest.fixture(scope="module")
def sweep(swept):
    """`llmtrain sweep --grid model.n_layers=1,2 --seeds 2`: 4 runs, named by the base (abl)."""
    sweeps = swept.dirs["sweep"]
    return SimpleNamespace(
        cmd=swept.commands["sweep"],
        proc=swept.done["sweep"],
        dir=(sweeps / "abl").resolve(),
        sweeps=sweeps,
    )


@pytest.fixture(scope="module")
def failed(bases, swept):
    """Three zipped runs: one good, one whose lr of 1e9 makes a gradient non-finite, one whose
    seq_len is longer than the model's max_seq_len (it fails as it starts). No list repeats a
    value: --zip refuses one given twice, even where the zipped rows all differ."""
    sweeps = swept.dirs["failed"]
    ids = ["lr=0.001,seq_len=32", "lr=1e+09,seq_len=16", "lr=0.002,seq_len=100"]
    return SimpleNamespace(
        proc=swept.done["failed"],
        dir=(sweeps / "f").resolve(),
        sweeps=sweeps,
        base=bases.small,
        axes=FAILED_AXES,
        ids=ids,
    )


def compare(*args: object) -> subprocess.CompletedProcess:
    return ts.run(ts.llmtrain("compare", *args), timeout=600)


def compare_to(path: Path, *args: object) -> str:
    """`compare -o path` (its format by the suffix): the file's text."""
    compare(*args, "-o", path)
    return path.read_text()


# --- 1. the sweep itself ---


def test_a_grid_with_seeds_trains_every_run_in_its_own_directory(sweep):
    err = sweep.proc.stderr
    assert "Traceback" not in err
    assert f"sweep abl: 4 runs in {sweep.dir}" in err
    for i, run_id in enumerate(IDS, 1):
        assert f"[{i}/4] {run_id}: finished in " in err, err
    assert "sweep abl: all 4 runs finished" in err
    assert sorted(p.name for p in sweep.dir.iterdir() if p.is_dir()) == sorted(IDS)

    manifest = json.loads((sweep.dir / "manifest.json").read_text())
    assert manifest["name"] == "abl"
    assert manifest["varied"] == ["model.n_layers", "seed"]
    assert manifest["runs"] == [
        {"id": f"n_layers={n},seed={s}", "settings": {"model.n_layers": n, "seed": s}}
        for n in (1, 2)
        for s in (0, 1)
    ]

    first_losses, non_embedding, params = {}, {}, {}
    for run_id in IDS:
        n_layers, seed = (int(part.split("=")[1]) for part in run_id.split(","))
        run_dir = sweep.dir / run_id
        config = config_of(run_dir)
        assert config["name"] == run_id
        assert config["model"]["n_layers"] == n_layers and config["seed"] == seed
        assert Path(config["run_dir"]).resolve() == sweep.dir
        assert config["optimizer"]["lr"] == 3e-3 and config["training"]["steps"] == STEPS

        summary = summary_of(run_dir)
        assert summary["status"] == "finished", summary
        assert summary["step"] == summary["total_steps"] == STEPS
        assert summary["tokens"] == TOKENS and summary["world_size"] == 1
        assert summary["error"] is None and summary["wall_time_s"] > 0
        assert 0 < summary["non_embedding_params"] < summary["params"]
        assert summary["flops_per_token"] > 6 * summary["non_embedding_params"]
        non_embedding[n_layers] = summary["non_embedding_params"]
        params[n_layers] = summary["params"]

        metrics = metrics_of(run_dir)
        assert list(metrics) == list(range(1, STEPS + 1)), run_id
        assert metrics[1]["loss"] == pytest.approx(math.log(320), rel=0.05)  # near uniform
        assert metrics[STEPS]["loss"] < metrics[1]["loss"] - 0.5, run_id
        assert [s for s, m in metrics.items() if "eval_loss" in m] == [6, 12]
        assert metrics[12]["eval_loss"] < metrics[6]["eval_loss"] < metrics[1]["loss"]
        assert metrics[STEPS]["tokens"] == TOKENS
        assert ts.committed_steps(run_dir / "checkpoints") == [6, 12]
        first_losses[run_id] = metrics[1]["loss"]
    # another seed or depth is another initialisation: the first losses all differ
    assert len(set(first_losses.values())) == 4, first_losses
    # a block adds to the non-embedding parameters; the embeddings do not grow with depth
    (one, two), (all_one, all_two) = sorted(non_embedding.items()), sorted(params.items())
    assert one[0] == all_one[0] == 1 and two[0] == all_two[0] == 2
    assert two[1] > one[1] and all_two[1] - two[1] == all_one[1] - one[1]


def test_a_run_repeats_alone_from_its_config_yaml(sweep, tmp_path):
    run_dir = sweep.dir / "n_layers=2,seed=1"
    copy = tmp_path / "copy.yaml"
    shutil.copy(run_dir / "config.yaml", copy)
    ts.run(ts.llmtrain("run", copy, f"run_dir={tmp_path / 'alone'}", "name=again"), timeout=600)
    alone = metrics_of(tmp_path / "alone" / "again")
    swept = metrics_of(run_dir)
    assert list(alone) == list(swept)
    ts.assert_close_runs(swept, alone, RTOL, KEYS)


# --- 2. compare ---


def test_compare_shows_each_setting_once_with_mean_and_std_over_seeds(sweep, tmp_path):
    finals = {run_id: final_eval_loss(sweep.dir / run_id) for run_id in IDS}
    by_layers = {n: [finals[f"n_layers={n},seed={s}"] for s in (0, 1)] for n in (1, 2)}

    lines = compare(sweep.dir).stdout.splitlines()
    assert lines[0].split()[:3] == ["n_layers", "runs", "status"]
    rows = lines[2:]
    assert [row.split()[:4] for row in rows] == [
        ["1", "2", "2", "finished"],
        ["2", "2", "2", "finished"],
    ]
    for row, n in zip(rows, (1, 2), strict=True):
        mean = statistics.fmean(by_layers[n])
        assert "±" in row
        assert f"{mean:.4f} ± {statistics.stdev(by_layers[n]):.4f}" in row, row

    out = tmp_path / "x.csv"
    proc = compare(sweep.dir, "-o", out)
    assert proc.stdout == "" and f"4 runs in 2 rows -> {out}" in proc.stderr
    table = list(csv.DictReader(out.open()))
    assert [row["model.n_layers"] for row in table] == ["1", "2"]
    for row, n in zip(table, (1, 2), strict=True):
        assert row["runs"] == "2" and row["status"] == "2 finished"
        assert row["run_dirs"].split(";") == [
            str(sweep.dir / f"n_layers={n},seed={s}") for s in (0, 1)
        ]
        assert float(row["final_eval_loss"]) == pytest.approx(
            statistics.fmean(by_layers[n]), rel=1e-12
        )
        assert float(row["final_eval_loss_std"]) == pytest.approx(
            statistics.stdev(by_layers[n]), rel=1e-12
        )
        assert float(row["tokens"]) == TOKENS and float(row["tokens_std"]) == 0

    markdown = compare_to(tmp_path / "x.md", sweep.dir, "--per-run").splitlines()
    assert markdown[0].startswith("| n_layers | seed | status")
    assert set(markdown[1]) == {"|", "-"}
    body = [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown[2:]]
    assert len(body) == 4 and all(line.startswith("| ") for line in markdown[2:])
    assert [cells[:3] for cells in body] == [
        [str(n), str(s), "finished"] for n in (1, 2) for s in (0, 1)
    ]
    assert [cells[3] for cells in body] == [f"{finals[run_id]:.4f}" for run_id in IDS]


def test_compare_sorts_rows_by_a_result(sweep, tmp_path):
    finals = {str(sweep.dir / run_id): final_eval_loss(sweep.dir / run_id) for run_id in IDS}
    text = compare_to(tmp_path / "runs.csv", sweep.dir, "--per-run", "--sort", "final_eval_loss")
    rows = list(csv.DictReader(text.splitlines()))
    assert [row["run_dirs"] for row in rows] == sorted(finals, key=finals.get)
    values = [float(row["final_eval_loss"]) for row in rows]
    assert values == sorted(finals.values())

    grouped = compare_to(tmp_path / "rows.csv", sweep.dir, "--sort", "final_eval_loss")
    means = [float(row["final_eval_loss"]) for row in csv.DictReader(grouped.splitlines())]
    assert len(means) == 2 and means == sorted(means)

    bad = refused(ts.llmtrain("compare", sweep.dir, "--sort", "accuracy"))
    assert "--sort accuracy: not a result column here; one of final_eval_loss" in bad


# --- 3. plot ---


def test_plot_draws_png_and_svg_and_refuses_what_it_cannot_draw(sweep, tmp_path):
    png = tmp_path / "curves.png"
    proc = ts.run(ts.llmtrain("plot", sweep.dir, "-o", png), timeout=600)
    assert f"4 runs, loss, eval_loss -> {png}" in proc.stderr
    head = png.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert png_size(png) == (2 * 6 * 120, int(4.2 * 120))  # two panels of 6 x 4.2 in at 120 dpi

    svg = tmp_path / "loss.svg"
    args = ("--metric", "loss", "--x", "tokens", "--smooth", "0.5", "--log-y")
    proc = ts.run(ts.llmtrain("plot", sweep.dir, "-o", svg, *args), timeout=600)
    assert f"4 runs, loss -> {svg}" in proc.stderr
    text = svg.read_text()
    assert "<svg" in text and 'width="432pt"' in text  # one panel, 6 in wide

    jpg = tmp_path / "out.jpg"
    err = refused(ts.llmtrain("plot", sweep.dir, "-o", jpg))
    assert f"-o {jpg}: use a file ending in .png, .svg, .pdf" in err
    assert not jpg.exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    err = refused(ts.llmtrain("plot", empty, "-o", tmp_path / "none.png"))
    assert f"{empty}: holds no runs" in err
    assert not (tmp_path / "none.png").exists()


# --- 4. restart ---


def test_running_the_same_sweep_again_skips_the_finished_runs(sweep):
    def snapshot() -> dict:
        files = ("metrics.jsonl", "summary.json", "output.log", "config.yaml")
        return {
            (run_id, name): (
                (path := sweep.dir / run_id / name).stat().st_mtime_ns,
                path.read_bytes(),
            )
            for run_id in IDS
            for name in files
        }

    before = snapshot()
    proc = ts.run(sweep.cmd, timeout=600)
    for i, run_id in enumerate(IDS, 1):
        assert f"[{i}/4] {run_id}: finished before, skipped" in proc.stderr
    assert "running" not in proc.stderr and "resuming" not in proc.stderr
    assert "sweep abl: all 4 runs finished" in proc.stderr
    assert snapshot() == before


# --- 5. resume ---


def test_a_killed_sweep_resumes_its_run_to_the_uninterrupted_losses(bases, tmp_path):
    sweeps = tmp_path / "sweeps"
    killed = sweep_cmd(bases.long, sweeps, "--seeds", 2, "--name", "cut")
    run_dir = sweeps / "cut" / "seed=0"
    # the uninterrupted sweep goes on beside this one (a run's start is seconds of imports on
    # one core); its run is waited for at the end
    uninterrupted = ts.start(sweep_cmd(bases.long, sweeps, "--seeds", 1, "--name", "whole"))
    try:
        proc = ts.start(killed)
        try:
            deadline = time.monotonic() + 600
            while 6 not in ts.committed_steps(run_dir / "checkpoints"):
                assert proc.poll() is None, f"the sweep ended ({proc.returncode}) before step 6"
                assert time.monotonic() < deadline, "no checkpoint at step 6 after 600 s"
                time.sleep(0.002)
        finally:
            ts.stop_group(proc)  # the sweep and its run, each by its pid
            proc.communicate(timeout=30)
        check_killed_sweep_resumes(killed, sweeps, run_dir)
        whole_sweep = ts.finish(uninterrupted, timeout=600)
    finally:
        if uninterrupted.poll() is None:
            ts.stop_group(uninterrupted)
            uninterrupted.communicate()
    assert whole_sweep.returncode == 0, whole_sweep.stderr[-6000:]
    whole = metrics_of(sweeps / "whole" / "seed=0")
    got = metrics_of(run_dir)
    assert list(got) == list(whole) == list(range(1, 61))
    ts.assert_close_runs(whole, got, RTOL, KEYS)


def check_killed_sweep_resumes(
    killed: list[str], sweeps: Path, run_dir: Path, name: str = "cut"
) -> None:
    """The killed sweep left its first run unfinished and its second unstarted; run again, it
    resumes the first and runs the second."""
    assert not (run_dir / "summary.json").exists()
    assert ts.last_logged_step(run_dir / "metrics.jsonl") < 60, "killed too late"
    assert max(ts.committed_steps(run_dir / "checkpoints")) < 60
    assert not (sweeps / name / "seed=1" / "summary.json").exists()

    resumed = ts.run(killed, timeout=600)
    assert f"[1/2] seed=0: resuming (output: {run_dir.resolve()}/output.log)" in resumed.stderr
    assert "[2/2] seed=1: running" in resumed.stderr
    assert f"sweep {name}: all 2 runs finished" in resumed.stderr
    for seed in (0, 1):
        summary = summary_of(sweeps / name / f"seed={seed}")
        assert summary["status"] == "finished" and summary["step"] == 60
    starts = [
        line
        for line in (run_dir / "output.log").read_text().splitlines()
        if line.startswith("# ") and line.endswith(" --resume")
    ]
    assert len(starts) == 2, starts  # the log goes on: a line per start of the run
    events = [json.loads(line) for line in (run_dir / "logs" / "rank0.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "run.resumed"][-1] >= 6


def _start_in_own_group(cmd: list[str]) -> subprocess.Popen:
    """A sweep in a process group of its own, as a shell starts a job."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_mid_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Until the sweep's first run has committed step 6 and logged a step past it."""
    deadline = time.monotonic() + 600
    while not (
        6 in ts.committed_steps(run_dir / "checkpoints")
        and ts.last_logged_step(run_dir / "metrics.jsonl") > 6
    ):
        assert proc.poll() is None, f"the sweep ended ({proc.returncode}) before step 7"
        assert time.monotonic() < deadline, "no step 7 after 600 s"
        time.sleep(0.01)


def test_sigkill_of_the_sweeps_process_group_ends_its_run_and_the_sweep_resumes(bases, tmp_path):
    """The run is in the sweep's process group: `kill -9 -PGID` ends it with the sweep (before,
    it lived in a session of its own and trained on alone); the same sweep run again resumes
    the run and runs the other."""
    import psutil

    sweeps = tmp_path / "sweeps"
    cmd = sweep_cmd(bases.long, sweeps, "--seeds", 2, "--name", "grp")
    run_dir = sweeps / "grp" / "seed=0"
    proc = _start_in_own_group(cmd)
    family: list = []
    try:
        _wait_mid_run(proc, run_dir)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family and all(os.getpgid(p.pid) == proc.pid for p in family), family
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=120)
        assert not alive, f"still running after the sweep's group was killed: {alive}"
    finally:
        ts.stop_group(proc)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    check_killed_sweep_resumes(cmd, sweeps, run_dir, name="grp")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal: Linux")
def test_sigkill_of_the_sweep_alone_stops_its_run_with_a_checkpoint_and_it_resumes(bases, tmp_path):
    """Only the sweep's own process is killed: its run gets SIGTERM (a parent-death signal),
    saves and stops instead of training on; the sweep run again resumes it from there."""
    import psutil

    sweeps = tmp_path / "sweeps"
    cmd = sweep_cmd(bases.long, sweeps, "--seeds", 1, "--name", "alone")
    run_dir = sweeps / "alone" / "seed=0"
    proc = _start_in_own_group(cmd)
    family: list = []
    try:
        _wait_mid_run(proc, run_dir)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family, "the sweep has no run process"
        os.kill(proc.pid, 9)
        proc.communicate(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=600)
        assert not alive, f"still running 600 s after the sweep was killed: {alive}"
    finally:
        ts.stop_group(proc)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    summary = summary_of(run_dir)
    assert summary["status"] == "stopped" and 6 < summary["step"] < 60, summary
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == summary["step"]
    assert ts.last_logged_step(run_dir / "metrics.jsonl") == summary["step"]

    resumed = ts.run(cmd, timeout=600)
    assert "[1/1] seed=0: resuming" in resumed.stderr, resumed.stderr[-3000:]
    assert "sweep alone: all 1 runs finished" in resumed.stderr
    assert summary_of(run_dir)["status"] == "finished"
    assert list(metrics_of(run_dir)) == list(range(1, 61))
    events = [json.loads(line) for line in (run_dir / "logs" / "rank0.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "run.resumed"] == [summary["step"]]


def test_sigterm_to_the_sweep_stops_its_run_with_a_checkpoint(bases, tmp_path):
    """The sweep passes SIGTERM on to its run (which ignores the terminal's SIGINT: Ctrl-C is
    the sweep's to answer the same way), the run saves and stops, the sweep exits with 130 and
    nothing is left running."""
    import psutil

    sweeps = tmp_path / "sweeps"
    cmd = sweep_cmd(bases.long, sweeps, "--seeds", 2, "--name", "term")
    run_dir = sweeps / "term" / "seed=0"
    proc = ts.start(cmd)
    try:
        deadline = time.monotonic() + 120
        while ts.last_logged_step(run_dir / "metrics.jsonl") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.01)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family, "the sweep has no run process"
        proc.send_signal(15)
        _, err = proc.communicate(timeout=600)
    finally:
        ts.stop_group(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "[1/2] seed=0: interrupted; stopping the run" in err
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
    summary = summary_of(run_dir)
    assert summary["status"] == "stopped" and 3 <= summary["step"] < 60
    assert ts.committed_steps(run_dir / "checkpoints")[-1] == summary["step"]
    assert not (sweeps / "term" / "seed=1" / "summary.json").exists()


# --- 6. failures ---


def test_failed_runs_are_reported_and_the_others_finish(failed, tmp_path):
    err = failed.proc.stderr
    assert failed.proc.returncode == 1, err
    assert "Traceback" not in err
    good, nan, long = (failed.dir / run_id for run_id in failed.ids)
    assert "[1/3] lr=0.001,seq_len=32: finished in " in err
    assert "sweep f: 1 of 3 runs finished; 2 failed:" in err
    report = {line.split(": ", 1)[0].strip(): line for line in err.splitlines() if line[:2] == "  "}
    assert "exit code 2: NonFiniteError: step " in report["lr=1e+09,seq_len=16"]
    assert "is not finite" in report["lr=1e+09,seq_len=16"]
    assert "exit code 2: " in report["lr=0.002,seq_len=100"]
    assert (
        "data.seq_len: 100 is longer than the model's max_seq_len (64)"
        in report["lr=0.002,seq_len=100"]
    )
    assert "finished runs are skipped" in err

    assert summary_of(good)["status"] == "finished" and summary_of(good)["step"] == STEPS
    assert list(metrics_of(good)) == list(range(1, STEPS + 1))

    # the lr of 1e9 was applied (a third of it in the first warmup step) and broke step 2
    summary = summary_of(nan)
    assert summary["status"] == "failed" and summary["error"].startswith("NonFiniteError: step 2")
    logged = ts.read_metrics(nan)
    assert [m["step"] for m in logged] == [1]
    assert logged[0]["lr"] == pytest.approx(1e9 / 3)

    summary = summary_of(long)
    assert summary["status"] == "failed" and summary["step"] == 0 and summary["exit_code"] == 2
    assert "data.seq_len: 100 is longer than the model's max_seq_len (64)" in summary["error"]
    assert not (long / "metrics.jsonl").exists() or not ts.read_metrics(long)

    rows = list(csv.DictReader(compare_to(tmp_path / "x.csv", failed.dir).splitlines()))
    status = {Path(row["run_dirs"]).name: row["status"] for row in rows}
    assert status == dict(zip(failed.ids, ["finished", "failed", "failed"], strict=True))
    table = compare(failed.dir).stdout.splitlines()
    assert [row.split()[:3] for row in table[2:]] == [
        ["32", "0.001", "finished"],
        ["16", "1e+09", "failed"],
        ["100", "0.002", "failed"],
    ]


# --- 7. bad input ---


@pytest.mark.parametrize(
    ("base", "args", "expected"),
    [
        (
            "small",
            ["--grid", "model.n_layerz=1,2"],
            ["model.n_layerz: unknown key (did you mean 'n_layers'?)"],
        ),
        (
            "small",
            ["--zip", "model.n_layers=1,2", "--zip", "optimizer.lr=1e-3,2e-3,3e-3"],
            [
                "the zipped lists must have the same length: model.n_layers has 2, optimizer.lr has 3"
            ],
        ),
        (
            "mix",
            ["--grid", "data.weights=[0.5,0.5],[0.2,0.3,0.5]"],
            [
                "data.weights: each value must list 2 weights (one per data.train entry), got [0.2, 0.3, 0.5]"
            ],
        ),
        (
            "small",
            ["--grid", "model.n_heads=4,5"],
            ["model.n_heads: must divide d_model=32, got 5"],
        ),
        (
            "small",
            [
                "--grid",
                "model.n_layers=1,2",
                "--launch",
                "slurm",
                "--nproc-per-node",
                8,
                "--nodes",
                2,
            ],
            ["data.global_batch: 8 sequences per step do not divide into 16 data-parallel ranks"],
        ),
        ("small", ["--grid", "model.n_layers=1,1"], ["a value is given twice"]),
        ("small", ["--seeds", 2, "--grid", "seed=0,1"], ["seed is swept twice"]),
    ],
    ids=["unknown-key", "zip-lengths", "weights-count", "bad-value", "batch", "twice", "seed"],
)
def test_bad_axes_are_refused_before_anything_is_written(bases, tmp_path, base, args, expected):
    sweeps = tmp_path / "sweeps"
    err = refused(sweep_cmd(getattr(bases, base), sweeps, *args))
    for text in expected:
        assert text in err, err
    assert not sweeps.exists(), list(sweeps.rglob("*"))


# --- 8. SLURM ---


def test_slurm_writes_a_job_array_over_the_runs(bases, tmp_path):
    sweeps = tmp_path / "sweeps"
    args = ("--grid", "model.n_layers=1,2,3", "--grid", "optimizer.lr=1e-3,3e-3")
    slurm = ("--launch", "slurm", "--nproc-per-node", 8, "--nodes", 2)
    slurm += ("--slurm", "partition=gpu", "--max-parallel", 2)
    proc = ts.run(sweep_cmd(bases.big, sweeps, *args, *slurm), timeout=600)
    sweep_dir = (sweeps / "big").resolve()
    script = sweep_dir / "sweep.sbatch"
    assert proc.stdout == f"sbatch {shlex.quote(str(script))}\n"
    assert "6 runs to go (0 finished)" in proc.stderr

    ids = [f"n_layers={n},lr={lr}" for n in (1, 2, 3) for lr in ("0.001", "0.003")]
    configs = [str(sweep_dir / run_id / "config.yaml") for run_id in ids]
    assert slurm_configs(script) == configs
    assert all(Path(c).exists() for c in configs)
    assert not list(sweep_dir.rglob("metrics.jsonl"))  # nothing ran
    lines = script.read_text().splitlines()
    for line in ("#SBATCH --array=0-5%2", "#SBATCH --nodes=2", "#SBATCH --partition=gpu"):
        assert line in lines, script.read_text()
    assert any("--nproc-per-node=8" in line for line in lines)
    subprocess.run(["bash", "-n", str(script)], check=True)

    # task 3 under stand-ins for srun, scontrol and torchrun: what torchrun is given
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "torchrun.args"
    stand_ins = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
        "scontrol": '[[ "$1" == show ]] && printf "node7\\nnode8\\n"; true',
        "torchrun": f'printf "%s\\n" "$@" > {shlex.quote(str(record))}',
    }
    for name, body in stand_ins.items():
        (fake / name).write_text(f"#!/bin/bash\n{body}\n")
        (fake / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_ARRAY_JOB_ID": "77",
        "SLURM_JOB_ID": "80",  # task 3's own job id: its rendezvous port
        "SLURM_JOB_NODELIST": "node[7-8]",
        "SLURM_NNODES": "2",
    }
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    assert record.read_text().splitlines() == [
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node7:20080",
        "--rdzv-id=77_3",
        "-m",
        "llmtrain",
        "run",
        configs[3],
        "--resume",
    ]


def test_slurm_and_print_cover_only_the_unfinished_runs(failed, sweep):
    again = sweep_cmd(failed.base, failed.sweeps, *failed.axes, "--name", "f")
    printed = ts.run([*again, "--launch", "print"], timeout=600)
    assert "1 finished, 2 to run" in printed.stderr
    unfinished = [str(failed.dir / run_id / "config.yaml") for run_id in failed.ids[1:]]
    assert [shlex.split(line) for line in printed.stdout.splitlines()] == [
        ["llmtrain", "run", config, "--resume"] for config in unfinished
    ]

    proc = ts.run([*again, "--launch", "slurm"], timeout=600)
    script = failed.dir / "sweep.sbatch"
    assert proc.stdout == f"sbatch {shlex.quote(str(script))}\n"
    assert "#SBATCH --array=0-1" in script.read_text().splitlines()
    assert slurm_configs(script) == unfinished

    printed = ts.run([*sweep.cmd, "--launch", "print"], timeout=600)
    assert printed.stdout == "" and "4 finished, 0 to run" in printed.stderr
    proc = ts.run([*sweep.cmd, "--launch", "slurm"], timeout=600)
    assert proc.stdout == "" and "every run has finished; no script written" in proc.stderr
    assert not (sweep.dir / "sweep.sbatch").exists()


# --- 9. data mixtures ---


def test_a_weights_sweep_trains_each_run_on_its_mixture(bases, sweep, swept):
    sweeps, proc = swept.dirs["mix"], swept.done["mix"]
    assert "sweep mix: all 2 runs finished" in proc.stderr
    sweep_dir = sweeps / "mix"
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert [(r["id"], r["settings"]) for r in manifest["runs"]] == [
        ("weights=1-0", {"data.weights": [1, 0]}),
        ("weights=0-1", {"data.weights": [0, 1]}),
    ]
    base_train = yaml.safe_load(bases.mix.read_text())["data"]["train"]
    for run_id, weights in (("weights=1-0", [1.0, 0.0]), ("weights=0-1", [0.0, 1.0])):
        train = config_of(sweep_dir / run_id)["data"]["train"]
        assert [d["path"] for d in train] == [d["path"] for d in base_train]
        assert [d["weight"] for d in train] == weights
        assert summary_of(sweep_dir / run_id)["status"] == "finished"

    only_train = metrics_of(sweep_dir / "weights=1-0")
    only_valid = metrics_of(sweep_dir / "weights=0-1")
    # weight 0 leaves the valid corpus out: the run is the 1-dataset run with the same settings
    ts.assert_close_runs(metrics_of(sweep.dir / "n_layers=2,seed=0"), only_train, RTOL, KEYS)
    # same initial weights, other batches: every training loss differs, the first one too
    assert all(only_train[s]["loss"] != only_valid[s]["loss"] for s in range(1, STEPS + 1))

    lines = compare(sweep_dir).stdout.splitlines()
    assert lines[0].split()[:3] == ["0.weight", "1.weight", "status"]
    assert [line.split()[:2] for line in lines[2:]] == [["1", "0"], ["0", "1"]]
