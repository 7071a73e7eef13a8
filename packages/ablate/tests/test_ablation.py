"""Reading runs back, the short names of varied keys, the compare table and the plot, on
hand-made run directories (the real sweep runs in integration_tests/test_sweep.py)."""

from __future__ import annotations

import csv
import io
import json
import statistics

import pytest

from llmtrain.ablate import compare, plot, runs
from llmtrain.core_mesh.errors import UserError


def test_short_keys_keep_what_tells_keys_apart():
    short = runs.short_keys(["model.n_layers", "data.train.0.weight", "data.train.1.weight"])
    assert short == {
        "model.n_layers": "n_layers",
        "data.train.0.weight": "0.weight",
        "data.train.1.weight": "1.weight",
    }
    assert runs.short_keys(["model.dropout", "attn.dropout"]) == {
        "model.dropout": "model.dropout",
        "attn.dropout": "attn.dropout",
    }


# --- reading runs back ---
def base_config(name, layers, seed, lr=1e-3):
    return {
        "name": name,
        "seed": seed,
        "run_dir": "/x",
        "model": {"kind": "tiny", "n_layers": layers},
        "optimizer": {"kind": "adamw", "lr": lr},
        "checkpoint": {"dir": f"/ckpt/{name}"},
    }


@pytest.fixture
def four_runs(tmp_path, make_run):
    finals = {}
    for layers in (1, 2):
        for seed in (0, 1):
            name = f"L{layers}s{seed}"
            final = 3.0 - 0.5 * layers + 0.1 * seed
            finals[name] = final
            make_run(
                tmp_path / "sweep",
                name,
                base_config(name, layers, seed),
                [5.0, 4.0, final + 0.2],
                evals=[None, final + 0.3, final],
                summary={"status": "finished", "tokens": 300, "wall_time_s": 10.0 + layers},
                tokens_per_s=1000.0 * layers,
            )
    manifest = {"runs": [{"id": n} for n in finals]}
    (tmp_path / "sweep" / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "sweep", finals


def test_varied_keys_leave_out_where_runs_live(four_runs):
    found = runs.find_runs([four_runs[0]])
    assert [r.name for r in found] == list(four_runs[1])
    assert runs.varied_keys(found) == ["model.n_layers", "seed"]
    assert found[0].metrics[-1]["step"] == 3  # the half-written line is left out


def test_compare_means_and_sample_std_over_seeds(four_runs):
    keys, rows = compare.table(runs.find_runs([four_runs[0]]))
    assert keys == ["model.n_layers"]
    assert [row.settings for row in rows] == [{"model.n_layers": 1}, {"model.n_layers": 2}]
    finals = four_runs[1]
    for row, layers in zip(rows, (1, 2), strict=True):
        expected = [finals[f"L{layers}s0"], finals[f"L{layers}s1"]]
        mean, std = row.stats("final_eval_loss")
        assert mean == pytest.approx(statistics.fmean(expected))
        assert std == pytest.approx(statistics.stdev(expected))
        assert row.stats("best_eval_loss")[0] == pytest.approx(statistics.fmean(expected))
        assert row.stats("wall_time_s") == (10.0 + layers, 0.0)
        assert row.stats("tokens_per_s")[0] == 1000.0 * layers
        assert row.status == "2 finished"

    text = compare.render(keys, rows, "markdown", sort="final_eval_loss")
    lines = text.splitlines()
    assert lines[0].startswith("| n_layers | runs | status")
    assert lines[2].startswith("| 2 ")  # lower loss first
    assert "2.0500 ± 0.0707" in lines[2]
    assert "mfu" not in lines[0]  # no run logged it

    table = list(csv.DictReader(io.StringIO(compare.render(keys, rows, "csv"))))
    assert float(table[0]["final_eval_loss"]) == pytest.approx(2.55)
    assert float(table[0]["final_eval_loss_std"]) == pytest.approx(statistics.stdev([2.5, 2.6]))
    with pytest.raises(UserError, match="--sort loss_x"):
        compare.render(keys, rows, "table", sort="loss_x")


def test_compare_per_run_and_unfinished(tmp_path, make_run):
    make_run(tmp_path, "a", base_config("a", 1, 0), [4.0, 3.0], summary={"status": "failed"})
    make_run(tmp_path, "b", base_config("b", 1, 0, lr=2e-3), [4.0])
    keys, rows = compare.table(runs.find_runs([tmp_path / "a", tmp_path / "b"]), per_run=True)
    assert keys == ["optimizer.lr"]
    assert [row.status for row in rows] == ["failed", "incomplete"]
    text = compare.render(keys, rows, "table")
    assert text.splitlines()[2].split()[:2] == ["0.001", "failed"]


def test_find_runs_errors(tmp_path):
    with pytest.raises(UserError, match="no such run"):
        runs.find_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no runs"):
        runs.find_runs([tmp_path / "empty"])


def test_plot_writes_png_and_svg(four_runs, tmp_path):
    found = runs.find_runs([four_runs[0]])
    drawn = plot.plot(found, tmp_path / "out.png", x="tokens", smoothing=0.5)
    assert drawn == ["loss", "eval_loss"]
    data = (tmp_path / "out.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    plot.plot(found, tmp_path / "out.svg", metrics=["loss"])
    svg = (tmp_path / "out.svg").read_text()
    assert "<svg" in svg and "n_layers=1 (2 seeds)" in svg
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(UserError, match="ending in"):
        plot.plot(found, tmp_path / "out.jpg")
    with pytest.raises(UserError, match="nothing to plot"):
        plot.plot(found, tmp_path / "x.png", metrics=["mfu"])


def test_smoothing_is_a_bias_corrected_ema():
    assert plot.smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    out = plot.smooth([2.0, 2.0, 2.0], 0.9)
    assert out == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    out = plot.smooth([0.0, 10.0], 0.5)
    assert out[1] == pytest.approx((0.5 * 0.0 * 0.5 + 0.5 * 10.0) / (1 - 0.25))
