"""Cost of the observability features on the steps they do not touch.

    python tools/bench_observe.py [--steps 120] [--repeats 3] [--model tiny|30m]

Four Trainer runs over the same data, alternated `--repeats` times (best median of each):
- reference: the hang watchdog off, no profiler;
- watchdog: the default (a thread checking the current step four times a second);
- profiled: the watchdog and `profile: {every: 10, warmup: 1, active: 1}`;
- callbacks: the default and 8 idle plugin callbacks (each hears before_step, after_step and
  on_log, and does nothing).
Each logs every step; the figure is the median step time over the steps outside profiler windows
(steps s with s % 10 in {0, 1} are left out of every run alike). Prints each variant's median step
time, the profiler's ratio (profiled against watchdog, which differ only in the windows), the
watchdog's (watchdog against reference) and the idle callbacks' (callbacks against watchdog);
goal for each: overhead < 1%, ratio >= 0.99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from bench_train import MODELS, make_data

from llmtrain.core_mesh.config import load_config
from llmtrain.core_mesh.interfaces import Callback
from llmtrain.core_mesh.plugins import PluginManager, hookimpl
from llmtrain.train_loop.run_config import RunConfig
from llmtrain.train_loop.trainer import Trainer

VARIANTS = {
    "reference": "debug: {watchdog: {enabled: false}}\n",
    "watchdog": "",
    "profiled": "profile: {every: 10, warmup: 1, active: 1}\n",
    "callbacks": "callbacks: [" + ", ".join(["{kind: idle}"] * 8) + "]\n",
}


class Idle(Callback):
    """Hears the per-step events and does nothing: what a callback costs by being there."""

    def __init__(self, options: None):
        pass

    def before_step(self, run, step):
        pass

    def after_step(self, run, step, metrics):
        pass

    def on_log(self, run, step, metrics, rank_metrics):
        pass


class IdlePlugin:
    @hookimpl
    def llmtrain_callbacks(self, register):
        register("idle", Idle, help="does nothing")


def run(work: Path, data: str, model: dict, args, variant: str, repeat: int, plugins) -> float:
    model_yaml = ", ".join(f"{k}: {v}" for k, v in {**model, "max_seq_len": args.seq_len}.items())
    path = work / f"{variant}-{repeat}.yaml"
    path.write_text(
        f"""\
name: {variant}-{repeat}
run_dir: {work / "runs"}
device: cpu
model: {{{model_yaml}}}
data: {{train: [{{path: {data}}}], seq_len: {args.seq_len}, micro_batch: {args.batch}}}
optimizer: {{kind: adamw, lr: 1.0e-3}}
training: {{steps: {args.steps}, log_every: 1}}
checkpoint: {{resume: never}}
loggers: [{{kind: jsonl}}]
{VARIANTS[variant]}"""
    )
    config = load_config(str(path), RunConfig, plugins=plugins)
    trainer = Trainer(config, plugins, resume=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    if variant == "profiled":
        traces = list((trainer.run_dir / "profiles").glob("step-*/rank0.json"))
        assert traces, "the profiled run wrote no trace"
    untouched = [m["step_time_s"] for m in lines if m["step"] > 10 and m["step"] % 10 not in (0, 1)]
    return statistics.median(untouched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    plugins = PluginManager().load_entry_points()
    plugins.register(IdlePlugin(), "bench-idle")
    best = {name: float("inf") for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work, plugins)
        for repeat in range(args.repeats):  # alternate: drift on a shared machine hits all three
            for variant in VARIANTS:
                step = run(work, data, MODELS[args.model], args, variant, repeat, plugins)
                best[variant] = min(best[variant], step)
    print(f"{'variant':10} {'median step':>12}")
    for name, step in best.items():
        print(f"{name:10} {1e3 * step:>10.3f}ms")
    profiler = best["watchdog"] / best["profiled"]  # the same run but for the profile windows
    watchdog = best["reference"] / best["watchdog"]
    print(f"\nprofiler on untouched steps: ratio {profiler:.3f} (goal >= 0.99)")
    print(f"watchdog: ratio {watchdog:.3f} (goal >= 0.99)")
    idle = best["watchdog"] / best["callbacks"]
    print(f"8 idle callbacks: ratio {idle:.3f} (goal >= 0.99)")


if __name__ == "__main__":
    main()
