"""Signal and noise (`llmtrain.ablate.signal_noise`, `compare`'s and the report's section): every
number recomputed by hand from the raw values with numpy, independently of the module, on
sweeps written in the layout a run writes (config.yaml, metrics.jsonl, eval_tasks.json,
summary.json). One sweep of 2 variants x 2 seeds holds a task for each outcome: decided (and
not from the final evaluation alone), more averaged checkpoints needed, more seeds needed,
drop. Then one run per variant (seed noise unmeasured: a lower bound), runs with one
evaluation (left out, said so), runs with fewer evaluations than K, held-out losses alone
(printed with --last-evals only), the option's refusals and the report's section."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from scipy.stats import norm

from llmtrain.ablate import runs, signal_noise

Z = norm.ppf(0.975)
STEPS = [10, 20, 30, 40, 50]  # evaluated steps; the last 4 are averaged by default
WIGGLE = np.array([0.0, 0.01, -0.01, 0.01, -0.01])  # checkpoint noise, the same in every run
# per task: each run's level (its last four evaluations are level + WIGGLE[1:]), by
# (n_layers, seed). Seeds alike (no seed noise) for the first two; apart for the last two.
LEVELS = {
    "decide": {(1, 0): 0.30, (1, 1): 0.30, (2, 0): 0.315, (2, 1): 0.315},
    "moreckpt": {(1, 0): 0.30, (1, 1): 0.30, (2, 0): 0.308, (2, 1): 0.308},
    "moreseeds": {(1, 0): 0.30, (1, 1): 0.34, (2, 0): 0.34, (2, 1): 0.38},
    "drop": {(1, 0): 0.30, (1, 1): 0.34, (2, 0): 0.301, (2, 1): 0.341},
}
EVAL_LOSS = {(1, 0): 3.0, (1, 1): 3.1, (2, 0): 2.7, (2, 1): 2.75}


def write_run(root, n_layers, seed, steps=STEPS, tasks=LEVELS, ema=True):
    """A run as training writes it: config.yaml, metrics.jsonl (a train line per step, the eval
    loss at every evaluated step), eval_tasks.json (each task at every evaluated step; with
    `ema` a `hellaswag@ema` task too) and summary.json."""
    name = f"n_layers={n_layers},seed={seed}"
    path = root / name
    path.mkdir(parents=True)
    config = {"name": name, "seed": seed, "run_dir": str(path), "model": {"n_layers": n_layers}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []
    evaluations = []
    for i, step in enumerate(steps):
        lines.append({"step": step, "loss": 4.0, "tokens": step * 64})
        wiggle = WIGGLE[i - len(steps) + len(WIGGLE)]
        lines.append({"step": step, "eval_loss": EVAL_LOSS[n_layers, seed] + 3 * wiggle})
        scores = {
            task: {"scoring": "multiple_choice", "items": 500, "truncated": 0, "shots": 0,
                   "acc": levels[n_layers, seed] + wiggle, "acc_stderr": 0.02}
            for task, levels in tasks.items()
        }  # fmt: skip
        if ema:
            scores["hellaswag@ema"] = {"acc": 0.25 + 0.01 * n_layers + 0.002 * seed + wiggle / 2}
        evaluations.append({"step": step, "tasks": scores})
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    document = {"format": 1, "evaluations": evaluations}
    (path / "eval_tasks.json").write_text(json.dumps(document))
    (path / "summary.json").write_text(json.dumps({"status": "finished", "step": steps[-1]}))
    return path


@pytest.fixture
def sweep(tmp_path):
    for n_layers in (1, 2):
        for seed in (0, 1):
            write_run(tmp_path, n_layers, seed)
    return tmp_path


def raw_values(root, metric, last=4):
    """{variant: [each run's last `last` values]} read straight from the files."""
    out = {}
    for run_dir in sorted(root.iterdir()):
        n_layers = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["n_layers"]
        if metric.startswith("downstream/"):
            _, task, name = metric.split("/")
            evaluations = json.loads((run_dir / "eval_tasks.json").read_text())["evaluations"]
            values = [e["tasks"][task][name] for e in evaluations]
        else:
            lines = [
                json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ]
            values = [line[metric] for line in lines if metric in line]
        out.setdefault(n_layers, []).append(np.array(values[-last:]))
    return out


def by_hand(variants, z=Z, max_suggested=64):
    """Every number of the section from the raw values (the formula of the README)."""
    runs_x = [x for members in variants.values() for x in members]
    k_r = np.array([len(x) for x in runs_x])
    ckpt = math.sqrt(
        sum(((x - x.mean()) ** 2).sum() for x in runs_x) / (k_r - 1).sum()
    )  # pooled within-run sample std
    k = len(k_r) / (1 / k_r).sum()
    m_v = {v: np.mean([x.mean() for x in members]) for v, members in variants.items()}
    between_df = sum(len(members) - 1 for members in variants.values())
    seed = 0.0
    if between_df:
        s_b2 = (
            sum(sum((x.mean() - m_v[v]) ** 2 for x in members) for v, members in variants.items())
            / between_df
        )
        seed = math.sqrt(max(0.0, s_b2 - ckpt**2 / k))
    n = min(len(members) for members in variants.values())
    signal = max(m_v.values()) - min(m_v.values())

    def se(n, k):
        return math.sqrt(2 * (seed**2 / n + ckpt**2 / (n * k)))

    def decides(n, k):
        return signal > 0 and signal >= z * se(n, k)

    decided = decides(n, k)
    k_needed = seeds_needed = None
    if not decided:
        k_needed = next((kk for kk in range(1, max_suggested + 1) if kk > k and decides(n, kk)),
                        None)  # fmt: skip
        if k_needed is None:
            seeds_needed = next(
                (nn for nn in range(n + 1, max_suggested + 1) if decides(nn, k)), None
            )
    return {
        "signal": signal,
        "checkpoint_noise": ckpt,
        "seed_noise": seed if between_df else None,
        "noise": math.sqrt(seed**2 + ckpt**2),
        "snr": signal / ckpt,
        "se": se(n, k),
        "threshold": z * se(n, k),
        "k": k,
        "n": n,
        "decided": decided,
        "decided_final_only": decides(n, 1),
        "k_needed": k_needed,
        "seeds_needed": seeds_needed,
        "scores": sorted(m_v.values()),
    }


def compare_json(run_cli, *args):
    code, out, err = run_cli("compare", *args, "--json")
    assert code == 0, err
    return json.loads(out)


METRICS = [
    "eval_loss",
    *(f"downstream/{task}/acc" for task in ["decide", "drop", "hellaswag@ema"]),
    "downstream/moreckpt/acc",
    "downstream/moreseeds/acc",
]


def test_every_number_is_the_hand_recomputation(sweep, run_cli):
    document = compare_json(run_cli, sweep)
    got = {entry["metric"]: entry for entry in document["signal_noise"]}
    assert sorted(got) == sorted(METRICS)
    assert document["signal_noise_left_out"] == []
    for metric in METRICS:
        expected = by_hand(raw_values(sweep, metric))
        entry = got[metric]
        for key, value in expected.items():
            if key == "scores":
                assert sorted(v["score"] for v in entry["variants"]) == pytest.approx(value)
            elif isinstance(value, float):
                assert entry[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (metric, key)
            else:
                assert entry[key] == value, (metric, key)
        assert entry["z"] == pytest.approx(1.959963984540054)
        assert entry["k_min"] == entry["k_max"] == 4
        for variant in entry["variants"]:
            assert len(variant["runs"]) == 2 and all(len(x) == 4 for x in variant["values"])


def test_each_outcome_and_its_sentence(sweep, run_cli):
    """decide: decided with 4 averaged evaluations, not from the final one alone; moreckpt:
    K' averaged evaluations would; moreseeds: more checkpoints cannot (seed noise), n' seeds
    would; drop: nothing within 64 would."""
    got = {e["metric"]: e for e in compare_json(run_cli, sweep)["signal_noise"]}
    decide = got["downstream/decide/acc"]
    assert decide["decided"] and not decide["decided_final_only"] and decide["verdict"] == "decided"
    assert decide["seed_noise"] == 0.0 and decide["seed_noise_measured"]
    assert (
        "separates the variants at 95%; from the final evaluation alone it would not"
        in (decide["sentence"])
    )
    # signal 0.008, checkpoint noise sqrt(4e-4/3): 1.96 sqrt(4e-4/3 / K') <= 0.008 at K' = 9
    more = got["downstream/moreckpt/acc"]
    assert not more["decided"] and more["k_needed"] == 9 and more["verdict"] == "K=9"
    assert "averaging the last 9 evaluations of each run would separate them" in more["sentence"]
    assert "eval-tasks --last 9" in more["sentence"]
    # signal 0.04; seed noise beyond what any K removes; sqrt(2 (s^2 + c^2/4) / n) at n = 4
    seeds = got["downstream/moreseeds/acc"]
    assert seeds["k_needed"] is None and seeds["seeds_needed"] == 4
    assert (
        seeds["verdict"] == "n=4"
        and "4 seeds per variant would separate them" in (seeds["sentence"])
    )
    drop = got["downstream/drop/acc"]
    assert drop["drop"] and drop["verdict"] == "drop"
    assert drop["k_needed"] is None and drop["seeds_needed"] is None
    assert drop["sentence"].endswith(
        "cannot separate the variants at this scale: drop it or evaluate at a larger scale."
    )
    assert got["eval_loss"]["decided"] and got["eval_loss"]["decided_final_only"]

    code, out, err = run_cli("compare", sweep)
    assert code == 0, err
    text = out[out.index("signal and noise") :]
    assert max(len(line) for line in out.splitlines()) <= 100  # fits a laptop terminal
    header = text.splitlines()[1].split()
    assert header == ["metric", "K", "signal", "ckpt", "noise", "seed", "noise", "SNR", "verdict"]
    table_rows = {line.split()[0]: line.split() for line in text.splitlines()[3:9]}
    assert table_rows["downstream/moreckpt/acc"][1:] == [
        "4", "0.0080", "0.0115", "0.0000", f"{0.008 / math.sqrt(4e-4 / 3):.2f}", "K=9"
    ]  # fmt: skip
    assert table_rows["downstream/drop/acc"][-1] == "drop"
    assert "downstream/decide/acc: signal 0.0150 against 1.96 x se" in " ".join(text.split())


def test_one_run_per_variant_leaves_seed_noise_unmeasured_and_a_lower_bound(tmp_path, run_cli):
    for n_layers in (1, 2):
        write_run(tmp_path, n_layers, 0, tasks={"moreckpt": LEVELS["moreckpt"]}, ema=False)
    got = {e["metric"]: e for e in compare_json(run_cli, tmp_path)["signal_noise"]}
    more = got["downstream/moreckpt/acc"]
    expected = by_hand(raw_values(tmp_path, "downstream/moreckpt/acc"))
    assert expected["seed_noise"] is None and more["seed_noise"] is None
    assert not more["seed_noise_measured"] and more["n"] == 1
    assert more["k_needed"] == expected["k_needed"] == 17 and more["verdict"] == "K=≥17"
    assert more["sentence"].endswith(
        "Seed noise is unmeasured (one run per variant), taken as 0: this figure is a lower bound."
    )
    assert got["eval_loss"]["decided"]
    assert "the true noise may be larger" in got["eval_loss"]["sentence"]
    code, out, _ = run_cli("compare", tmp_path)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("downstream/moreckpt/acc "))
    assert "unmeasured" in line.split()


def test_one_evaluation_has_no_checkpoint_noise_and_is_left_out(tmp_path, run_cli):
    """A metric no run evaluated twice is left out of the table and named below it; a sweep
    where no metric was evaluated twice prints no section at all. A run with fewer evaluations
    than K averages what it has (K_h the harmonic mean of the runs' counts)."""
    for n_layers in (1, 2):
        for seed in (0, 1):
            write_run(tmp_path / "one", n_layers, seed, steps=[50])
    document = compare_json(run_cli, tmp_path / "one")
    assert document["signal_noise"] == [] and "eval_loss" in document["signal_noise_left_out"]
    code, out, _ = run_cli("compare", tmp_path / "one")
    assert code == 0 and "signal and noise" not in out

    # eval_loss evaluated 2 or 4 times per run, the tasks once
    mixed = tmp_path / "mixed"
    for n_layers in (1, 2):
        for seed in (0, 1):
            path = write_run(mixed, n_layers, seed, steps=[50])
            steps = STEPS[-2:] if seed else STEPS
            lines = [
                {"step": s, "eval_loss": EVAL_LOSS[n_layers, seed] + 3 * WIGGLE[i - len(steps)]}
                for i, s in enumerate(steps)
            ]
            (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    document = compare_json(run_cli, mixed)
    (entry,) = document["signal_noise"]
    assert entry["metric"] == "eval_loss" and (entry["k_min"], entry["k_max"]) == (2, 4)
    expected = by_hand(raw_values(mixed, "eval_loss"))
    assert entry["k"] == pytest.approx(expected["k"]) == pytest.approx(8 / 3)
    assert entry["checkpoint_noise"] == pytest.approx(expected["checkpoint_noise"])
    assert entry["seed_noise"] == pytest.approx(expected["seed_noise"])
    assert set(document["signal_noise_left_out"]) == {
        "downstream/decide/acc", "downstream/drop/acc", "downstream/moreckpt/acc",
        "downstream/moreseeds/acc", "downstream/hellaswag@ema/acc",
    }  # fmt: skip
    # held-out losses alone: the table shows the section when --last-evals asks for it
    code, out, _ = run_cli("compare", mixed)
    assert code == 0 and "signal and noise" not in out
    code, out, _ = run_cli("compare", mixed, "--last-evals", 4)
    line = next(x for x in out.splitlines() if x.startswith("eval_loss "))
    assert line.split()[1] == "2-4"
    assert "not shown (one evaluation per run, no checkpoint noise): downstream/" in out


def test_last_evals_chooses_k(sweep, run_cli):
    for last in (2, 3, 5):
        got = {
            e["metric"]: e
            for e in compare_json(run_cli, sweep, "--last-evals", last)["signal_noise"]
        }
        for metric in ("downstream/moreseeds/acc", "eval_loss"):
            expected = by_hand(raw_values(sweep, metric, last=last))
            for key in ("signal", "checkpoint_noise", "seed_noise", "snr", "se"):
                assert got[metric][key] == pytest.approx(expected[key], abs=1e-12), (last, key)
            assert got[metric]["k_max"] == last


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "four"])
def test_bad_last_evals_is_one_error_line(sweep, run_cli, value):
    for command in ("compare", "report"):
        extra = ["-o", sweep / "r.html"] if command == "report" else []
        code, out, err = run_cli(command, sweep, *extra, "--last-evals", value)
        assert code == 2 and out == ""
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert "--last-evals" in err and value in err


def test_the_measure_api_and_a_single_variant(sweep):
    found = runs.find_runs([sweep])
    measured, left_out = signal_noise.measure_all(found)
    assert [m.metric for m in measured] == signal_noise.metrics_of(found) and left_out == []
    one = [run for run in found if "n_layers=1" in run.name]
    result = signal_noise.measure(one, "downstream/decide/acc")
    assert result is not None and result.signal is None and result.verdict == "one variant"
    assert "one variant, nothing to separate" in result.sentence


def test_the_report_shows_the_section_and_calls_out_the_tasks_to_drop(sweep, run_cli):
    pytest.importorskip("matplotlib")
    code, _, err = run_cli("report", sweep, "-o", sweep / "report.html")
    assert code == 0, err
    page = (sweep / "report.html").read_text()
    section = page[page.index('<section id="signal-noise-section">') :]
    section = section[: section.index("</section>")]
    assert "<h2>Signal and noise</h2>" in section
    drop = section[section.index('id="signal-noise-drop"') :].split("</p>")[0]
    assert "downstream/drop/acc" in drop and "downstream/decide/acc" not in drop
    assert '<td class="drop">drop</td>' in section
    assert '<td class="significant">decided</td>' in section
    assert "would separate them (eval-tasks --last 9)" in section
    assert page.index("signal-noise-section") < page.index("<h2>Curves</h2>")


def test_a_saturated_task_has_no_spread_and_is_dropped(tmp_path, run_cli):
    """Every run scores 1.0 at every evaluation: no signal, no noise, no ratio (0 / 0)."""
    for n_layers in (1, 2):
        for seed in (0, 1):
            path = write_run(tmp_path, n_layers, seed, tasks={}, ema=False)
            evaluations = [{"step": s, "tasks": {"easy": {"acc": 1.0}}} for s in STEPS]
            (path / "eval_tasks.json").write_text(json.dumps({"evaluations": evaluations}))
    got = {e["metric"]: e for e in compare_json(run_cli, tmp_path)["signal_noise"]}
    easy = got["downstream/easy/acc"]
    assert easy["signal"] == easy["checkpoint_noise"] == easy["seed_noise"] == 0.0
    assert easy["snr"] is None and easy["drop"] and easy["verdict"] == "drop"
    assert "every variant scores the same: cannot separate the variants" in easy["sentence"]
    code, out, _ = run_cli("compare", tmp_path)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("downstream/easy/acc "))
    assert line.split()[1:] == ["4", "0.0000", "0.0000", "0.0000", "drop"]
