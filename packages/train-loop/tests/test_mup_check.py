"""`llmtrain mup-check`: µP's coordinate check, measured on tiny widths on CPU.

The thresholds were set from measurements (tiny preset, widths 32/64/128, mup_base_width 32,
AdamW lr 5e-3, 10 steps on the generated corpus): under µP every kind's last-step log-log slope
against width was within 0.13 in magnitude (logits 0.00) for seed 0 and within 0.37 over seeds
0-2 (the MLP output, the smallest and noisiest); under standard the logits' slope was 0.71-0.77
and the hidden outputs' above 1.2.

A µP check that is not flat was one "NOT flat" line; it now tells a steady change (µP not
holding, with typical causes) from one at widths too small or too few to judge, and from a
slope without a steady trend (noise), judged by the slopes between neighbouring widths and over
the last steps (issue 51: the quickstart's config read "NOT flat" with no hint which it was).
The flat line and the standard parametrization's line are unchanged.
"""

from __future__ import annotations

import json

import attrs
import pytest

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.plugins import PluginManager, hookimpl
from llmtrain.train_loop.experiments.mup_check import KINDS, Check, loglog_slope, verdict

HIDDEN = ("attention", "mlp", "block")


def write_config(tmp_path, dataset, model="{kind: tiny, mup_base_width: 32}"):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"""\
name: mup
model: {model}
data:
  train: [{{path: {dataset}}}]
  seq_len: 32
  micro_batch: 4
optimizer: {{kind: adamw, lr: 5.0e-3, weight_decay: 0.0}}
training: {{steps: 10}}
"""
    )
    return path


def test_loglog_slope():
    assert loglog_slope([1, 2, 4], [3, 3, 3]) == pytest.approx(0.0)
    assert loglog_slope([1, 2, 4], [1, 2**0.5, 2]) == pytest.approx(0.5)
    assert loglog_slope([10, 100], [5, 50]) == pytest.approx(1.0)


def fake_check(parametrization, power, zero=()):
    """Every kind at widths 1, 2, 4 sized width**power (0 for the kinds in `zero`), 1 step."""
    sizes = {k: [[1.0, 0.0 if k in zero else w**power] for w in (1, 2, 4)] for k in KINDS}
    return Check(parametrization, (1, 2, 4), sizes, sizes, [[1.0]] * 3)


def test_verdict_reads_the_slopes():
    assert verdict([fake_check("mup", 0.1), fake_check("standard", 0.5)]) == [
        "mup: flat with width (largest |slope| 0.10, embedding size; flat means below 0.25)",
        "standard: logits grow with width (slope 0.50; growing means above 0.35; largest "
        "|slope| 0.50, embedding size)",
    ]
    [line] = verdict([fake_check("mup", 0.3, zero=("embedding",))])
    assert line.startswith("mup: NOT flat with width (largest |slope| 0.30, attention size")
    # a steady growth (the same slope between every two widths) is a µP problem: the line
    # says which kinds grow and what typically causes it (issue 51: the bare "NOT flat" left
    # the user guessing between noise and a config problem)
    assert "change steadily with width" in line and "typical causes: attention:" in line
    [line] = verdict([fake_check("standard", 0.2)])
    assert line.startswith("standard: logits do not grow with width (slope 0.20")
    assert fake_check("mup", 0.1, zero=("mlp",)).as_json()["slopes"]["sizes"]["mlp"] is None


def measured_check(attention, widths=(64, 128, 256), head_dim=16, late=None):
    """Every kind flat at 1.0 but the attention output, sized `attention` by width at the last
    step; `late`: its sizes at the earlier steps of the last half (one list by width each)."""
    sizes = {k: [[1.0, 1.0] for _ in widths] for k in KINDS}
    earlier = list(zip(*late, strict=True)) if late else [() for _ in widths]
    sizes["attention"] = [[1.0, *e, a] for a, e in zip(attention, earlier, strict=True)]
    return Check("mup", tuple(widths), sizes, sizes, [[1.0]] * len(widths), head_dim=head_dim)


def test_a_slope_without_a_steady_trend_is_called_noise_and_says_what_to_run():
    # the quickstart's config at widths 64, 128, 256 (4 to 16 heads): the attention output grows
    # from 64 to 128 and hardly from 128 to 256, a slope of 0.61 over the three
    [line] = verdict([measured_check([0.598, 1.22, 1.39])])
    assert line.startswith(
        "mup: NOT flat, but no steady trend with width (largest |slope| 0.61, attention size; "
        "flat means below 0.25): its slope between neighbouring widths is not steady "
        "(64->128: +1.03, 128->256: +0.19). That is finite-width noise rather than a µP "
        "problem; to judge, use widths of 8 or more heads (the smallest here has 4), e.g. "
        "--widths 128,256,512,1024;"
    ), line
    # two widths: the step-to-step slopes are the noise; and too few widths is said
    [line] = verdict(
        [measured_check([1.0, 2.0], widths=(256, 512), late=[[1.0, 1.3], [1.0, 0.7], [1.0, 1.6]])]
    )
    assert "its slope over the last 3 steps moves between -0.51 and +1.00" in line, line
    assert "give 3 or more widths" in line and "heads" not in line
    # steady on both counts: a µP problem, not noise
    [line] = verdict(
        [measured_check([1.0, 1.5, 2.25], widths=(128, 256, 512), late=[[1.0, 1.4, 2.0]])]
    )
    assert line.startswith("mup: NOT flat with width (largest |slope| 0.58, attention size")
    assert "attention size +0.58" in line and "typical causes: attention:" in line


def test_flat_under_mup_growing_under_standard(tmp_path, dataset, run_cli):
    config = write_config(tmp_path, dataset)
    figure = tmp_path / "coord.png"
    code, out, err = run_cli(
        "mup-check", config, "--widths", "32,64,128", "--steps", "10", "--json", "-o", figure
    )
    assert code == 0, err
    report = json.loads(out)
    checks = {c["parametrization"]: c for c in report["checks"]}
    assert set(checks) == {"standard", "mup"}
    for check in checks.values():
        assert check["widths"] == [32, 64, 128]
        # 11 points a width: at init, then after each of the 10 steps
        assert all(len(steps) == 11 for steps in check["sizes"]["logits"])
        # training moved the model: the loss fell at every width
        assert all(losses[-1] < losses[0] for losses in check["losses"])
    mup, standard = checks["mup"]["slopes"], checks["standard"]["slopes"]
    for kind in ("logits", *HIDDEN):
        assert abs(mup["sizes"][kind]) < 0.25, (kind, mup)
        assert abs(mup["updates"][kind]) < 0.25, (kind, mup)
    assert abs(mup["sizes"]["logits"]) < 0.1
    assert standard["sizes"]["logits"] > 0.35
    assert standard["updates"]["logits"] > 0.35
    for kind in HIDDEN:
        assert standard["updates"][kind] > 0.75, (kind, standard)
    # at the base width µP is the standard model: the same numbers
    assert checks["mup"]["sizes"]["logits"][0] == pytest.approx(
        checks["standard"]["sizes"]["logits"][0], rel=1e-5
    )
    assert "verdict: mup: flat with width" in err
    assert "verdict: standard: logits grow with width" in err
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_and_one_parametrization(tmp_path, dataset, run_cli):
    config = write_config(tmp_path, dataset)
    code, out, err = run_cli(
        "mup-check", config, "--widths", "32,64", "--steps", "2", "--parametrization", "mup"
    )
    assert code == 0, err
    assert "mup: size after 2 steps, by width" in out
    assert "standard" not in out
    lines = [line.split() for line in out.splitlines()]
    logits = next(line for line in lines if line[:2] == ["logits", "size"])
    assert len(logits) == 5  # kind, two widths, the slope
    assert "verdict: mup:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--widths", "32,40"], "--widths: 40 is not a multiple of the model's head size 16"),
        (["--widths", "64"], "--widths 64: give at least two different positive widths"),
        (["--widths", "32,x"], "--widths 32,x: give comma-separated whole numbers"),
        (["--widths", "32,48"], "multiples of 32"),  # 3 heads: not a multiple of 2 per kv head
        (["--widths", "32,64", "--steps", "0"], "--steps must be at least 1"),
        (["--widths", "32,64", "-o", "coord.txt"], "-o coord.txt: use a file ending in .png"),
    ],
)
def test_bad_options(tmp_path, dataset, run_cli, argv, message):
    code, _out, err = run_cli("mup-check", write_config(tmp_path, dataset), *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: CONFIG, --widths"),
        (["{config}"], "the following arguments are required: --widths"),
        (["{config}", "--widths", "32,64", "--steps", "abc"], "argument --steps: invalid int"),
        (["{config}", "--widths", "32,64", "--parametrization", "x"], "invalid choice: 'x'"),
    ],
)
def test_argument_errors_are_one_line(tmp_path, dataset, run_cli, argv, message):
    config = write_config(tmp_path, dataset)
    code, out, err = run_cli("mup-check", *(a.format(config=config) for a in argv))
    assert (code, out) == (2, "")
    [line] = err.splitlines()  # not argparse's usage block
    assert line.startswith("error: llmtrain mup-check: ") and message in line
    assert line.endswith("; see llmtrain mup-check --help")


def test_an_output_that_cannot_be_the_figure_file_is_refused_before_the_check(
    tmp_path, dataset, run_cli
):
    config = write_config(tmp_path, dataset)
    folder = tmp_path / "figure.png"
    folder.mkdir()
    code, out, err = run_cli("mup-check", config, "--widths", "32,64", "-o", folder)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"error: -o {folder} is a directory; -o names the figure file to write, e.g. "
        f"{folder / 'coord.png'}"
    ]
    assert list(folder.iterdir()) == []
    code, out, err = run_cli("mup-check", config, "--widths", "32,64", "-o", config / "f.png")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"error: -o {config / 'f.png'}: {config} is a file, not a directory to write the figure in"
    ]


def test_sgd_under_mup_is_refused(tmp_path, dataset, run_cli):
    config = write_config(tmp_path, dataset)
    code, _out, err = run_cli(
        "mup-check", config, "optimizer={kind: sgd}", "--widths", "32,64", "--steps", "1"
    )
    assert code == 2
    assert "optimizer." in err and "parametrization mup" in err
    assert len(err.strip().splitlines()) == 1, err


@attrs.frozen(kw_only=True)
class ToyOptions:
    max_seq_len: int = 64


class Toy:
    @hookimpl
    def llmtrain_models(self, register):
        register("toy", object(), options=ToyOptions)


def test_a_model_that_is_not_a_transformer_is_refused(tmp_path, dataset, capsys):
    plugins = PluginManager(blocked=()).load_entry_points()
    plugins.register(Toy(), "toy")
    config = write_config(tmp_path, dataset, model="{kind: toy}")
    code = main(["mup-check", str(config), "--widths", "32,64"], plugins=plugins)
    err = capsys.readouterr().err
    assert code == 2
    assert "model.kind 'toy' has options ToyOptions; mup-check checks" in err
    assert len(err.strip().splitlines()) == 1, err
