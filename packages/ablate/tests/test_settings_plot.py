"""`llmtrain plot SWEEP --x optimizer.lr --group model.d_model`: the final loss of each run
against a setting, one curve per width, one panel per parametrization, the best lr marked and
printed (settings_plot.py), on hand-made runs whose best lr is known."""

from __future__ import annotations

import math

import pytest

from llmtrain.ablate import settings_plot
from llmtrain.ablate.runs import find_runs
from llmtrain.core_mesh.errors import UserError

LRS = (2.0**-9, 2.0**-8, 2.0**-7, 2.0**-6)
WIDTHS = {32: 4, 64: 8, 128: 16}  # d_model: n_heads (head_dim 8, stepped together)
# the index of the best lr per width: µP keeps it, standard moves it one step per doubling
BEST = {"mup": {32: 2, 64: 2, 128: 2}, "standard": {32: 3, 64: 2, 128: 1}}


def _loss(parametrization: str, width: int, i: int, seed: int = 0) -> float:
    return 2.0 + 0.1 * abs(i - BEST[parametrization][width]) + 0.01 * seed


def _sweep(tmp_path, make_run, seeds=(0,), failed=()):
    root = tmp_path / "sweep"
    for parametrization in BEST:
        for width, heads in WIDTHS.items():
            for i, lr in enumerate(LRS):
                for seed in seeds:
                    config = {
                        "seed": seed,
                        "name": f"{parametrization}-{width}-{i}-{seed}",
                        "model": {
                            "kind": "tiny",
                            "d_model": width,
                            "n_heads": heads,
                            "parametrization": parametrization,
                            "mup_base_width": 32,
                        },
                        "optimizer": {"kind": "adamw", "lr": lr},
                    }
                    loss = _loss(parametrization, width, i, seed)
                    status = "failed" if (parametrization, width, i) in failed else "finished"
                    make_run(
                        root,
                        config["name"],
                        config,
                        [loss + 1, loss + 0.5],
                        evals=[None, loss],
                        summary={"status": status},
                    )
    return root


def test_one_panel_per_parametrization_one_curve_per_width_best_lr_marked(tmp_path, make_run):
    runs = find_runs([_sweep(tmp_path, make_run)])
    panels = settings_plot.panels(runs, "optimizer.lr", "model.d_model")
    assert [p.settings for p in panels] == [
        {"model.parametrization": "mup"},
        {"model.parametrization": "standard"},
    ]
    for panel in panels:
        which = panel.settings["model.parametrization"]
        # n_heads steps with d_model (a --zip): it names the curve and splits no panel
        assert [c.settings for c in panel.curves] == [
            {"model.d_model": w, "model.n_heads": h} for w, h in WIDTHS.items()
        ]
        assert panel.xs == list(LRS)
        for curve in panel.curves:
            width = curve.settings["model.d_model"]
            assert [p.x for p in curve.points] == list(LRS)
            assert [p.value for p in curve.points] == pytest.approx(
                [_loss(which, width, i) for i in range(len(LRS))]
            )
            assert curve.best is not None and curve.best.x == LRS[BEST[which][width]]
    assert [p.best_spread() for p in panels] == [0, 2]


def test_seeds_are_averaged_and_unfinished_runs_are_never_the_best(tmp_path, make_run):
    root = _sweep(tmp_path, make_run, seeds=(0, 1), failed={("mup", 64, 2)})
    panels = settings_plot.panels(find_runs([root]), "lr", "d_model")  # short names work too
    mup = panels[0].curves
    point = mup[0].points[0]
    assert point.runs == 2 and point.values == pytest.approx((2.2, 2.21))
    assert point.value == pytest.approx(2.205)
    failed = mup[1].points[2]
    assert failed.value is None and failed.values == () and failed.runs == 2
    assert mup[1].best is not None and mup[1].best.x in (LRS[1], LRS[3])  # the next-best lr
    assert panels[0].best_spread() == 1


def test_the_cli_draws_the_figure_and_prints_the_best_lr_per_width(tmp_path, make_run, run_cli):
    pytest.importorskip("matplotlib")
    root = _sweep(tmp_path, make_run)
    out = tmp_path / "transfer.png"
    code, stdout, err = run_cli(
        "plot", root, "--x", "optimizer.lr", "--group", "model.d_model", "-o", out
    )
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = stdout.splitlines()
    assert lines[0] == "parametrization=mup: eval_loss"
    assert lines[1] == f"  d_model=32 n_heads=4: best lr {LRS[2]:g} ({_loss('mup', 32, 2):.4f})"
    assert "  the best lr spans 0 grid step(s) across the curves" in lines
    assert "  d_model=128 n_heads=16: best lr 0.00390625 (2.0000)" in lines
    assert "  the best lr spans 2 grid step(s) across the curves" in lines
    assert "24 runs, final eval_loss against optimizer.lr" in err
    code, _, err = run_cli("plot", root, "--x", "lr", "--metric", "loss", "-o", tmp_path / "t.svg")
    assert code == 0, err
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--x", "optimizer.lr", "--group", "lr"], "--group optimizer.lr: is the x axis"),
        (["--x", "model.parametrization"], "run "),
        (["--x", "optimizer.betas"], "--x optimizer.betas: not a setting of these runs"),
        (["--group", "model.d_model"], "--group model.d_model: groups points against a setting"),
        (["--x", "lr", "--smooth", "0.5"], "--smooth: is for curves over steps"),
        (["--x", "lr", "--per-run"], "--per-run: is for curves over steps"),
    ],
)
def test_bad_options_are_one_line(tmp_path, make_run, run_cli, argv, message):
    pytest.importorskip("matplotlib")
    root = _sweep(tmp_path, make_run)
    code, _, err = run_cli("plot", root, *argv, "-o", tmp_path / "x.png")
    assert code == 2
    assert message in err, err


def test_a_non_numeric_setting_names_the_run(tmp_path, make_run):
    runs = find_runs([_sweep(tmp_path, make_run)])
    with pytest.raises(UserError, match=r"--x model.parametrization: run .* has mup, not a number"):
        settings_plot.panels(runs, "model.parametrization")
    assert math.isfinite(settings_plot.panels(runs, "optimizer.lr")[0].curves[0].points[0].x)


def test_the_report_shows_the_figure_where_a_sweep_varies_the_lr_at_several_widths(
    tmp_path, make_run, run_cli
):
    pytest.importorskip("matplotlib")
    root = _sweep(tmp_path, make_run)
    out = tmp_path / "report.html"
    code, _, err = run_cli("report", root, "-o", out)
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    assert "<h2>Learning rate against width</h2>" in page
    assert 'id="transfer" alt="final eval_loss against optimizer.lr' in page
    assert 'src="data:image/png;base64,' in page[page.index('id="transfer"') :]
    best = page[page.index('<pre id="transfer-best">') :]
    best = best[: best.index("</pre>")]
    assert "the best lr spans 0 grid step(s)" in best and "the best lr spans 2 grid step(s)" in best
    # one width only: no such section
    one_width = tmp_path / "one-width"
    for run in root.iterdir():
        if "-32-" in run.name:
            (one_width / run.name).mkdir(parents=True)
            for file in run.iterdir():
                (one_width / run.name / file.name).write_bytes(file.read_bytes())
    code, _, err = run_cli("report", one_width, "-o", tmp_path / "one.html")
    assert code == 0, err
    assert "Learning rate against width" not in (tmp_path / "one.html").read_text()


def test_the_curves_of_a_large_sweep_put_their_legend_below_the_panels(tmp_path, make_run):
    """24 settings in a panel's legend would cover its curves (and collapse the layout): they
    go below the panels, in columns, and the figure grows to hold them."""
    pytest.importorskip("matplotlib")
    import struct
    import warnings

    from llmtrain.ablate import plot

    runs = find_runs([_sweep(tmp_path, make_run)])
    columns, inches = plot._legend_layout(
        ["d_model=32 n_heads=4 parametrization=mup lr=0.5"] * 24, 2
    )
    assert columns == 3 and inches == pytest.approx(0.3 + 0.17 * 8)
    assert plot._legend_layout(["a"] * plot.LEGEND_INSIDE, 2) is None
    out = tmp_path / "curves.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "constrained_layout not applied"
        plot.plot(runs, out)
    width, height = struct.unpack(">II", out.read_bytes()[16:24])
    assert height > 4.2 * 120 + 100 and width == 12 * 120
