"""The mixture study end to end, on llmtrain's own three domains (`quickstart --mixture`: prose,
code, and noise that no model can learn), through the commands a user runs:

1. a swarm of `--mixtures N` tiny proxy runs (`llmtrain sweep`);
2. `llmtrain fit --mixture --json` of the target that weights prose and code, with `--at` the
   uniform mixture and `--further` more random mixtures;
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

    rng = np.random.default_rng(12345)  # other draws than the swarm's
    further = [[round(float(w), 3) for w in rng.dirichlet([1.0] * 3)] for _ in range(args.further)]
    further = [[*w[:2], round(1 - w[0] - w[1], 3)] for w in further]
    target = TARGET_TEXT
    at = [arg for w in [[1 / 3] * 3, *further] for arg in ("--at", ",".join(f"{x:g}" for x in w))]
    fit = json.loads(
        llmtrain(
            "fit", f"{sweeps}/swarm", "--mixture", "--target", target, *at, "--json", capture=True
        )
    )
    chosen = [float(w) for w in fit["weights"]]
    predicted_further = [float(a["predicted"]) for a in fit["at"][1:]]

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
