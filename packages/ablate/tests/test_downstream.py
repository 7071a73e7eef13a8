"""Downstream metrics (`downstream/<task>/<metric>`) in `llmtrain compare` and `llmtrain plot`,
on a sweep written in the layout a run writes (manifest.json; per run config.yaml with its
provenance header, metrics.jsonl, summary.json): final and best values (best the highest for
accuracies, the lowest for perplexity and bits per byte), an accuracy's stderr beside it, mean ±
std over seeds, blanks where runs did not log a metric, CSV columns, and the plots."""

from __future__ import annotations

import csv
import json
import math
import statistics
import struct
from pathlib import Path

import pytest
import yaml

from llmtrain.ablate import compare, plot, runs

STEPS = 12
EVERY = 4  # downstream evaluation at steps 4, 8 and 12
ITEMS = 500  # an accuracy's stderr is sqrt(acc (1 - acc) / ITEMS)

# (n_layers, seed): task/metric -> its values at steps 4, 8, 12. The best accuracy and the best
# perplexity are not the final ones. n_layers=2,seed=1 has no lambada; n_layers=2 has no wiki.
DOWNSTREAM = {
    (1, 0): {
        "hellaswag/acc": [0.30, 0.42, 0.40],
        "hellaswag/acc_norm": [0.31, 0.35, 0.44],
        "lambada/perplexity": [60.0, 40.0, 45.0],
        "wiki/bits_per_byte": [1.9, 1.5, 1.6],
    },
    (1, 1): {
        "hellaswag/acc": [0.28, 0.44, 0.38],
        "hellaswag/acc_norm": [0.30, 0.36, 0.46],
        "lambada/perplexity": [58.0, 42.0, 41.0],
        "wiki/bits_per_byte": [1.8, 1.4, 1.7],
    },
    (2, 0): {
        "hellaswag/acc": [0.35, 0.50, 0.48],
        "hellaswag/acc_norm": [0.36, 0.45, 0.52],
        "lambada/perplexity": [50.0, 30.0, 33.0],
    },
    (2, 1): {
        "hellaswag/acc": [0.33, 0.47, 0.49],
        "hellaswag/acc_norm": [0.37, 0.47, 0.51],
    },
}
# n_layers=2,seed=0 logs its downstream metrics on lines of their own (no `tokens` on them)
OWN_LINES = (2, 0)


def stderr(acc: float) -> float:
    return math.sqrt(acc * (1 - acc) / ITEMS)


def downstream_line(values: dict[str, list[float]], i: int) -> dict[str, float]:
    line = {}
    for name, series in values.items():
        line[f"downstream/{name}"] = series[i]
        if "/acc" in name:
            line[f"downstream/{name}_stderr"] = stderr(series[i])
    return line


def write_run(run: Path, n_layers: int, seed: int) -> None:
    run.mkdir(parents=True)
    config = {
        "name": run.name,
        "seed": seed,
        "run_dir": str(run.parent),
        "device": "cpu",
        "model": {"kind": "tiny", "vocab_size": 320, "max_seq_len": 64, "n_layers": n_layers},
        "data": {
            "train": [{"path": "/data/train.zarr", "weight": 1.0}],
            "seq_len": 32,
            "global_batch": 8,
            "eval": {"path": "/data/valid.zarr", "every": 6, "batches": 2},
        },
        "optimizer": {"kind": "adamw", "lr": 0.003},
        "training": {"steps": STEPS, "log_every": 1},
        "checkpoint": {"dir": None},
        "loggers": [{"kind": "console"}, {"kind": "jsonl"}],
    }
    header = "# written by llmtrain run\n# llmtrain-core-mesh 0.1.0\n"
    (run / "config.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
    values = DOWNSTREAM[n_layers, seed]
    lines = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "loss": 5.0 - 0.1 * step, "tokens": step * 256}
        if step % 6 == 0:
            row["eval_loss"] = 5.0 - 0.1 * step + 0.05
        extra = downstream_line(values, step // EVERY - 1) if step % EVERY == 0 else {}
        if (n_layers, seed) == OWN_LINES:
            lines.append(row)
            if extra:
                lines.append({"step": step, **extra})
        else:
            lines.append(row | extra)
        if extra:  # bookkeeping the callback logs beside the metrics: not results
            lines[-1] |= {"downstream/seconds": 2.5, "downstream/hellaswag/truncated": 3.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"status": "finished", "step": STEPS, "tokens": STEPS * 256, "wall_time_s": 9.0}
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def sweep(tmp_path) -> Path:
    sweep = tmp_path / "sweeps" / "abl"
    ids = []
    for n_layers, seed in DOWNSTREAM:
        run_id = f"n_layers={n_layers},seed={seed}"
        write_run(sweep / run_id, n_layers, seed)
        ids.append({"id": run_id, "settings": {"model.n_layers": n_layers, "seed": seed}})
    manifest = {"name": "abl", "varied": ["model.n_layers", "seed"], "runs": ids}
    (sweep / "manifest.json").write_text(json.dumps(manifest))
    return sweep


def final_and_best(values: list[float], higher: bool) -> tuple[float, float]:
    return values[-1], (max if higher else min)(values)


def test_which_way_is_best():
    assert runs.higher_is_better("downstream/hellaswag/acc")  # the name's rule
    assert runs.higher_is_better("downstream/hellaswag/acc_norm")
    assert not runs.higher_is_better("downstream/lambada/perplexity")
    assert not runs.higher_is_better("downstream/wiki/bits_per_byte")
    assert not runs.higher_is_better("eval_loss")


def test_the_direction_a_run_recorded_wins_over_the_name(tmp_path):
    def run(better: dict | None) -> runs.Run:
        summary = None if better is None else {"status": "finished", "better": better}
        return runs.Run(tmp_path, {}, [], summary)

    # a metric the name rule reads as a loss, recorded as improving upwards
    assert runs.higher_is_better("probe/score", [run({"probe/score": "higher"})])
    assert not runs.higher_is_better("probe/score", [run(None), run({"other": "higher"})])
    # an accuracy-named metric recorded as improving downwards
    assert not runs.higher_is_better("x/acc_gap", [run({"x/acc_gap": "lower"})])
    # runs written before directions were recorded: the rule
    assert runs.higher_is_better("x/acc_gap", [run(None)])


def test_downstream_metrics_found_and_their_steps(sweep):
    found = runs.find_runs([sweep])
    assert runs.downstream_metrics(found) == [
        "downstream/hellaswag/acc",
        "downstream/hellaswag/acc_norm",
        "downstream/lambada/perplexity",
        "downstream/wiki/bits_per_byte",
    ]
    own_lines = found[2]
    assert own_lines.name == "n_layers=2,seed=0"
    # the lines of their own take their tokens from the training line of the same step
    assert own_lines.series("downstream/hellaswag/acc", "tokens") == (
        [1024, 2048, 3072],
        DOWNSTREAM[OWN_LINES]["hellaswag/acc"],
    )


def test_final_and_best_per_run(sweep):
    metrics = runs.downstream_metrics(runs.find_runs([sweep]))
    _, rows = compare.table(runs.find_runs([sweep]), per_run=True, metrics=metrics)
    for row, values in zip(rows, DOWNSTREAM.values(), strict=True):
        for name in ("hellaswag/acc", "hellaswag/acc_norm", "lambada/perplexity"):
            if name not in values:
                assert row.stats(f"final_downstream/{name}") == (None, None)
                continue
            final, best = final_and_best(values[name], higher="acc" in name)
            assert row.stats(f"final_downstream/{name}") == (pytest.approx(final), None)
            assert row.stats(f"best_downstream/{name}") == (pytest.approx(best), None)
            if "acc" in name:  # the stderr logged at the step of that value
                assert row.stderr(f"final_downstream/{name}") == pytest.approx(stderr(final))
                assert row.stderr(f"best_downstream/{name}") == pytest.approx(stderr(best))
            else:
                assert row.stderr(f"best_downstream/{name}") is None

    text = compare.render(["model.n_layers", "seed"], rows, "markdown")
    header, _, first, *_, last = text.splitlines()
    cells = dict(zip(header.split("|"), first.split("|"), strict=True))
    cells = {k.strip(): v.strip() for k, v in cells.items()}
    assert cells["final_downstream/hellaswag/acc"] == f"0.4000 ± {stderr(0.40):.4f}"
    assert cells["best_downstream/hellaswag/acc"] == f"0.4200 ± {stderr(0.42):.4f}"
    assert cells["final_downstream/lambada/perplexity"] == "45.0000"
    assert cells["best_downstream/lambada/perplexity"] == "40.0000"
    assert cells["best_downstream/wiki/bits_per_byte"] == "1.5000"
    # n_layers=2,seed=1 logged neither lambada nor wiki: blank cells
    cells = {k.strip(): v.strip() for k, v in zip(header.split("|"), last.split("|"), strict=True)}
    assert cells["final_downstream/lambada/perplexity"] == ""
    assert cells["best_downstream/wiki/bits_per_byte"] == ""
    assert cells["final_downstream/hellaswag/acc"] == f"0.4900 ± {stderr(0.49):.4f}"


def test_compare_downstream_means_over_seeds(sweep, run_cli, tmp_path):
    code, _, err = run_cli("compare", sweep, "--downstream", "-o", tmp_path / "x.csv")
    assert code == 0, err
    table = list(csv.DictReader((tmp_path / "x.csv").open()))
    assert [row["model.n_layers"] for row in table] == ["1", "2"]
    for row, layers in zip(table, (1, 2), strict=True):
        seeds = [DOWNSTREAM[layers, 0], DOWNSTREAM[layers, 1]]
        for name in ("hellaswag/acc", "hellaswag/acc_norm"):
            finals = [final_and_best(s[name], higher=True)[0] for s in seeds]
            bests = [final_and_best(s[name], higher=True)[1] for s in seeds]
            column = f"downstream/{name}"
            assert float(row[f"final_{column}"]) == pytest.approx(statistics.fmean(finals))
            assert float(row[f"final_{column}_std"]) == pytest.approx(statistics.stdev(finals))
            assert float(row[f"best_{column}"]) == pytest.approx(statistics.fmean(bests))
            assert float(row[f"best_{column}_std"]) == pytest.approx(statistics.stdev(bests))
            mean_stderr = statistics.fmean(stderr(v) for v in bests)
            assert float(row[f"best_{column}_stderr"]) == pytest.approx(mean_stderr)
    one, two = table
    assert float(one["final_eval_loss"]) == pytest.approx(3.85)  # the fixed columns stay
    # n_layers=1: both seeds have lambada (best the lowest); n_layers=2: one seed, no std
    assert float(one["best_downstream/lambada/perplexity"]) == pytest.approx(40.5)
    assert float(one["final_downstream/lambada/perplexity"]) == pytest.approx(43.0)
    assert float(two["best_downstream/lambada/perplexity"]) == 30.0
    assert two["best_downstream/lambada/perplexity_std"] == ""
    assert two["final_downstream/wiki/bits_per_byte"] == ""  # no n_layers=2 run logged it
    assert float(one["final_downstream/wiki/bits_per_byte"]) == pytest.approx(1.65)

    code, out, _ = run_cli("compare", sweep, "--downstream", "--columns", "all")
    header, _, one, two = out.split("\n\n")[0].splitlines()  # signal and noise follows
    assert header.split()[:4] == ["n_layers", "runs", "status", "final_eval_loss"]
    acc = [0.40, 0.38]
    assert f"{statistics.fmean(acc):.4f} ± {statistics.stdev(acc):.4f}" in one
    assert "30.0000" in two  # one seed's perplexity, no ± (perplexity has no stderr)
    assert len(two.split()) < len(one.split())  # the blank wiki cells
    # the default columns: the final eval loss, each metric's final value (and tokens/s)
    code, out, _ = run_cli("compare", sweep, "--downstream")
    header = out.splitlines()[0].split()
    finals = [f"final_{m}" for m in runs.downstream_metrics(runs.find_runs([sweep]))]
    assert header == ["n_layers", "runs", "status", "final_eval_loss", *finals]  # no tokens/s


def test_compare_metric_and_sort(sweep, run_cli, tmp_path):
    code, _, err = run_cli(
        "compare", sweep, "--per-run", "--metric", "downstream/hellaswag/acc_norm",
        "--sort", "best_downstream/hellaswag/acc_norm", "-o", tmp_path / "metric.csv",
    )  # fmt: skip
    assert code == 0, err
    table = list(csv.DictReader((tmp_path / "metric.csv").open()))
    assert [c for c in table[0] if "downstream" in c] == [
        "final_downstream/hellaswag/acc_norm",
        "final_downstream/hellaswag/acc_norm_std",
        "final_downstream/hellaswag/acc_norm_ci_low",
        "final_downstream/hellaswag/acc_norm_ci_high",
        "final_downstream/hellaswag/acc_norm_stderr",
        "best_downstream/hellaswag/acc_norm",
        "best_downstream/hellaswag/acc_norm_std",
        "best_downstream/hellaswag/acc_norm_ci_low",
        "best_downstream/hellaswag/acc_norm_ci_high",
        "best_downstream/hellaswag/acc_norm_stderr",
    ]
    bests = [float(row["best_downstream/hellaswag/acc_norm"]) for row in table]
    assert bests == [0.52, 0.51, 0.46, 0.44]  # accuracies: the highest first

    code, _, _ = run_cli(
        "compare", sweep, "--per-run", "--downstream", "-o", tmp_path / "sorted.csv",
        "--sort", "best_downstream/lambada/perplexity",
    )  # fmt: skip
    table = list(csv.DictReader((tmp_path / "sorted.csv").open()))
    bests = [row["best_downstream/lambada/perplexity"] for row in table]
    assert bests == ["30.0", "40.0", "41.0", ""]  # perplexity: the lowest first, blanks last

    code, out, _ = run_cli("compare", sweep)
    table, _, signal_noise = out.partition("\n\n")
    assert "downstream" not in table  # columns only when asked for
    assert signal_noise.startswith("signal and noise")  # evaluated twice: can they decide?

    code, _, err = run_cli("compare", sweep, "--metric", "downstream/hellaswag/acc_nrom")
    assert code == 2 and "none of the 4 runs logged it" in err
    assert "downstream/hellaswag/acc_norm" in err  # what was logged
    code, _, err = run_cli("compare", sweep, "--metric", "downstream/hellaswag/acc_stderr")
    assert code == 2 and "use --metric downstream/hellaswag/acc" in err


def test_compare_downstream_without_any(tmp_path, sweep, run_cli):
    plain = tmp_path / "plain"
    write_run(plain, 1, 0)
    lines = (plain / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if "downstream" not in line]
    (plain / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    code, out, err = run_cli("compare", plain, "--downstream")
    assert code == 0 and "downstream" not in out
    assert "none of the runs logged a downstream/ metric" in err


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_plot_downstream_curves(sweep, tmp_path, run_cli):
    found = runs.find_runs([sweep])
    metric = "downstream/hellaswag/acc_norm"
    drawn = plot.plot(found, tmp_path / "acc.svg", x="tokens", metrics=[metric])
    assert drawn == [metric]
    svg = (tmp_path / "acc.svg").read_text()
    assert "hellaswag/acc_norm" in svg and "n_layers=2 (2 seeds)" in svg

    code, _, err = run_cli(
        "plot", sweep, "-o", tmp_path / "one.png", "--x", "tokens", "--metric", metric
    )
    assert code == 0, err
    assert f"4 runs, {metric} ->" in err
    assert png_size(tmp_path / "one.png") == (720, 504)  # one panel: 6 x 4.2 in at 120 dpi

    code, _, err = run_cli("plot", sweep, "-o", tmp_path / "all.png", "--downstream")
    assert code == 0, err
    everything = ["loss", "eval_loss", *runs.downstream_metrics(found)]
    assert f"4 runs, {', '.join(everything)} ->" in err
    assert png_size(tmp_path / "all.png") == (3 * 720, 2 * 504)  # 6 panels, 3 a row
    assert not list(tmp_path.glob("*.tmp"))
