"""The mixture study end to end, on llmtrain's own three domains (`quickstart --mixture`: prose,
code, and noise that no model can learn), through the commands a user runs:

1. a swarm of `--mixtures N` tiny proxy runs (`llmtrain sweep`);
2. `llmtrain fit --mixture --json` of the target that weights prose and code, with `--at` the
   uniform mixture and 200 fresh random mixtures within the swarm's range, of which `--further`
   are picked at evenly spaced quantiles of their predicted targets;
3. the predicted mixture and uniform weights trained with `--seeds S` each (one sweep, so
   `llmtrain compare --baseline` pairs them by seed);
4. the further mixtures trained, and their trained ranking against the fit's.

Prints the figures the issue asks for, one per line, and `ok` or `FAILED` against its goals:
cross-validated Spearman >= 0.8, at most 0.1 on noise, the predicted mixture beating uniform on
the target (lower, paired by seed), and the further mixtures ranked as the fit ranks them
(Spearman of predicted against trained). Exit 1 if a goal is missed. Several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

from llmtrain.train_loop.experiments.mixture_demo import DOMAINS
from llmtrain.train_loop.experiments.mixture_demo import TARGET as TARGET_TEXT

DRAWN = 200  # random mixtures the fit predicts, of which `--further` are trained
TARGET = {
    metric: float(weight) for metric, weight in (t.split("=") for t in TARGET_TEXT.split(","))
}


def llmtrain(*args: str, capture: bool = False) -> str:
    command = ["llmtrain", *args]
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, check=False, text=True, capture_output=capture)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {shlex.join(command)}\n{done.stderr or ''}")
    return done.stdout


def target_of(run_dir: Path) -> float:
    """The target from a run's summary.json (the last value of each eval metric)."""
    evals = json.loads((run_dir / "summary.json").read_text())["eval"]
    return sum(weight * evals[metric] for metric, weight in TARGET.items())


def listed(weights: list[float]) -> str:
    return "[" + ",".join(f"{w:g}" for w in weights) + "]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("mixture-check"))
    parser.add_argument("--mixtures", type=int, default=16, help="proxy runs (default 16)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the final pair (3)")
    parser.add_argument("--further", type=int, default=4, help="mixtures to rank (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each run")
    args = parser.parse_args()
    work = args.dir.resolve()
    started = time.perf_counter()
    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    llmtrain("quickstart", "--mixture", "--dir", str(work), *steps)
    base, sweeps = str(work / "mixture.yaml"), str(work / "sweeps")
    llmtrain("sweep", base, "--mixtures", str(args.mixtures), "--dir", sweeps, "--name", "swarm")

    # the further mixtures: fresh Dirichlet(1) draws (not the swarm's), the ones the fit puts at
    # evenly spaced quantiles of its predictions, so that they span the targets the fit expects
    # rather than fall within one run's noise of each other, and
    # within the range of weights the swarm tried (the fit trusts itself nowhere else)
    swarm = json.loads((Path(sweeps) / "swarm" / "manifest.json").read_text())
    tried = np.array([run["settings"]["data.weights"] for run in swarm["runs"]])
    rng = np.random.default_rng(12345)
    drawn: list[list[float]] = []
    while len(drawn) < DRAWN:
        w = [round(float(x), 3) for x in rng.dirichlet([1.0] * 3)]
        w = [*w[:2], round(1 - w[0] - w[1], 3)]
        if np.all((tried.min(axis=0) <= w) & (w <= tried.max(axis=0))):
            drawn.append(w)
    at = [arg for w in [[1 / 3] * 3, *drawn] for arg in ("--at", ",".join(f"{x:g}" for x in w))]
    fit = json.loads(
        llmtrain(
            "fit",
            f"{sweeps}/swarm",
            "--mixture",
            "--target",
            TARGET_TEXT,
            *at,
            "--json",
            capture=True,
        )
    )
    chosen = [float(w) for w in fit["weights"]]
    predictions = np.array([float(a["predicted"]) for a in fit["at"][1:]])
    order = np.argsort(predictions)
    picked = [order[int((i + 0.5) / args.further * DRAWN)] for i in range(args.further)]
    further = [drawn[i] for i in picked]
    predicted_further = [float(predictions[i]) for i in picked]

    uniform = [1.0, 1.0, 1.0]
    llmtrain(
        "sweep",
        base,
        "--grid",
        f"data.weights={listed(chosen)},{listed(uniform)}",
        "--seeds",
        str(args.seeds),
        "--dir",
        sweeps,
        "--name",
        "final",
    )
    llmtrain(
        "sweep",
        base,
        "--grid",
        "data.weights=" + ",".join(listed(w) for w in further),
        "--dir",
        sweeps,
        "--name",
        "further",
    )
    manifest = json.loads((Path(sweeps) / "final" / "manifest.json").read_text())
    paired: dict[int, dict[str, float]] = {}
    for run in manifest["runs"]:
        kind = "uniform" if run["settings"]["data.weights"] == uniform else "chosen"
        paired.setdefault(run["settings"]["seed"], {})[kind] = target_of(
            Path(sweeps) / "final" / run["id"]
        )
    gains = [pair["uniform"] - pair["chosen"] for pair in paired.values()]
    further_manifest = json.loads((Path(sweeps) / "further" / "manifest.json").read_text())
    trained_further = {
        tuple(run["settings"]["data.weights"]): target_of(Path(sweeps) / "further" / run["id"])
        for run in further_manifest["runs"]
    }
    trained = [trained_further[tuple(w)] for w in further]
    rank = stats.spearmanr(predicted_further, trained).statistic
    paired_t = stats.ttest_rel(
        [p["chosen"] for p in paired.values()], [p["uniform"] for p in paired.values()]
    )

    goals = {
        "cv_spearman >= 0.8": fit["cv_spearman"] >= 0.8,
        "noise weight <= 0.1": chosen[2] <= 0.1,
        "chosen beats uniform in every seed": all(g > 0 for g in gains),
        "further ranking agrees (spearman 1)": rank > 0.999,
    }
    print(
        f"swarm: {args.mixtures} runs; model {fit['model']}, cv_spearman {fit['cv_spearman']:.3f}"
    )
    print(f"chosen weights ({', '.join(DOMAINS)}): {listed(chosen)}")
    low, high = fit["interval"]
    print(f"predicted target {fit['predicted']:.4f} [{low:.4f}, {high:.4f}]")
    for seed, pair in sorted(paired.items()):
        print(f"seed {seed}: chosen {pair['chosen']:.4f}, uniform {pair['uniform']:.4f}")
    print(f"mean gain {np.mean(gains):.4f} (paired t p={paired_t.pvalue:.3g})")
    for w, p, t in zip(further, predicted_further, trained, strict=True):
        print(f"further {listed(w)}: predicted {p:.4f}, trained {t:.4f}")
    print(f"further ranking spearman {rank:.3f}")
    print(f"wall {time.perf_counter() - started:.0f} s")
    for goal, met in goals.items():
        print(f"{goal}: {'ok' if met else 'FAILED'}")
    print(f"compare: llmtrain compare {sweeps}/final --baseline data.weights={listed(uniform)}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
