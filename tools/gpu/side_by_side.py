"""The GPU kit's side-by-side with TorchTitan: what the bundle's torchtitan/ folder must hold,
reading TorchTitan's log, and the report's table of ratios and goals.

    python tools/gpu/side_by_side.py check-torchtitan .gpu-bundle/torchtitan
    python tools/gpu/side_by_side.py stage-torchtitan SRC DEST [--python-version 3.11]

Standard library only: bundle.sh runs the check with whichever python3 builds the bundle.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL_PINS = HERE / "torchtitan_wheels.txt"
# what run_tt.sh reads beside itself (cpu_smoke_train.py only in a dry run); wheels come from
# torchtitan_wheels.txt
TT_FILES = (
    "run_tt.sh",
    "llama3_1b.toml",
    "tt_llama1b.py",
    "cpu_smoke_train.py",
    "data/corpus.jsonl.gz",
    "assets/tokenizer/tokenizer.json",
    "assets/tokenizer/tokenizer_config.json",
)
SEQ_LEN = 2048
# windows ending at step >= 20 (steps 11-40 of 40): what run_tt.sh's TT_SUMMARY averages, and
# what our runs are averaged over, so both sides time the same steps
STEADY_FROM = 20
# llama-1b tied at seq 2048, counted as TorchTitan (and Megatron, PaLM) count: 6 x every matmul
# parameter, the tied head included (6 x 1,235,814,400), plus attention 12 x L x d x S without
# causal halving (12 x 16 x 2048 x 2048)
FLOPS_PER_TOKEN = 6 * 1_235_814_400 + 12 * 16 * 2048 * SEQ_LEN  # 8.2202e9
# dense bf16 peaks by device-name substring, first match first; the same figures as
# llmtrain.train_loop.builtin_callbacks.PEAK_TFLOPS (this file cannot import llmtrain)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}
GOAL_TT = 1.0  # our tokens/s against TorchTitan's, same shape
GOAL_DOC_MASKING = 0.97  # doc masking against the same run unmasked
MFU_TOLERANCE = 0.01  # relative: metrics.jsonl's MFU against the hand count


# ------------------------------------------------------------------------------ the folder
def wheel_pins() -> list[tuple[str, str, str]]:
    """(subfolder of wheels/, name, version) per pinned wheel."""
    pins = []
    for line in WHEEL_PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            where, _, pin = line.rpartition("/")
            name, _, version = pin.partition("==")
            pins.append((where, name, version))
    return pins


def check_torchtitan(folder: Path) -> list[str]:
    """What the folder lacks for the torchtitan steps (empty: complete)."""
    problems = []
    for name in TT_FILES:
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            problems.append(f"{name} is missing or empty")
    for where, name, version in wheel_pins():
        # a wheel's file name spells the distribution with underscores
        stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}-".lower()
        wheels = folder / "wheels" / where
        if not any(p.name.lower().startswith(stem) for p in wheels.glob("*.whl")):
            problems.append(f"wheels/{where + '/' if where else ''}{name}=={version} is missing")
    return problems


def usable(wheel: str, version: tuple[int, int]) -> bool:
    """A pure-Python wheel's tags against a Python version (the TorchTitan wheels are all
    pure; multiprocess ships one wheel per Python minor)."""
    python_tags, abi, platform = wheel.removesuffix(".whl").split("-")[-3:]
    wanted = {"py3", f"py{version[0]}{version[1]}", f"cp{version[0]}{version[1]}"}
    return (
        bool(wanted & set(python_tags.split(".")))
        and abi in ("none", "abi3")
        and (platform == "any" or "x86_64" in platform)
    )


def stage_torchtitan(source: Path, dest: Path, version: tuple[int, int]) -> None:
    """A dry run's copy of the folder (links) whose wheels/ hold only those that install on
    the dry run's Python: the bundle is made for the GPU machine's 3.12, and run_tt.sh installs
    every wheel it finds. What is left out must come from that Python's environment."""
    shutil.rmtree(dest, ignore_errors=True)  # removes the links, never what they point to
    dest.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "wheels":
            (dest / entry.name).symlink_to(entry.resolve())
    for wheel in sorted((source / "wheels").rglob("*.whl")):
        target = dest / wheel.relative_to(source)
        if usable(wheel.name, version):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(wheel.resolve())
        else:
            print(f"dry run: {wheel.name} does not install on Python {version[0]}.{version[1]}")


# ------------------------------------------------------------------------------ TorchTitan's log
STEP_LINE = re.compile(
    r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%"
)


def torchtitan_figures(log: Path, dry: bool) -> dict:
    """From run_tt.sh's tt.log: mean tokens/s and MFU over the steady windows (TT_SUMMARY's),
    peak reserved memory (its `memory:` field: max reserved GiB in each window; the allocator
    never gives memory back in a run, so the largest is the run's peak), the peak FLOP/s it
    assumed, its parameter count and the SDPA kernels its probe saw."""
    text = log.read_text()
    rows = [
        (int(m[1]), float(m[2]), float(m[3].replace(",", "")), float(m[4]) / 100)
        for m in STEP_LINE.finditer(text)
    ]
    if not rows:
        raise ValueError(f"no step lines in {log}")
    steady = [r for r in rows if r[0] >= STEADY_FROM] or (rows if dry else [])
    if not steady:
        raise ValueError(f"no window ending at step >= {STEADY_FROM} in {log}")
    figures = {
        "tokens_per_s": statistics.mean(r[2] for r in steady),
        "mfu": statistics.mean(r[3] for r in steady),
        "peak_reserved_gib": max(r[1] for r in rows),
        "windows": [r[0] for r in steady],
    }
    if m := re.search(r"Peak FLOPS used for computing MFU:\s*([\d.e+]+)", text):
        figures["peak_flops"] = float(m[1])
    if m := re.search(r"Model (\S+) (\S+) size: ([\d,]+) total parameters", text):
        figures["params"] = int(m[3].replace(",", ""))
    if m := re.search(r"^SDPA ops.*$", text, re.MULTILINE):
        figures["sdpa"] = m[0]
    return figures


# ------------------------------------------------------------------------------ the table
# (row, step, reference step of its ratio)
ROWS = (
    ("TorchTitan b4", "torchtitan-b4", None),
    ("llmtrain b4", "llama-b4", "torchtitan-b4"),
    ("TorchTitan b8", "torchtitan-b8", None),
    ("llmtrain b8", "llama-b8", "torchtitan-b8"),
    ("llmtrain b4, doc masking", "llama-b4-docmask", "llama-b4"),
    ("llmtrain b4, float8", "llama-b4-float8", "torchtitan-b4"),
    # what the host reads a step made before issue 47 cost (debug.host_syncs puts them back):
    # a ratio below 1 is what keeping the numbers on the device won
    ("llmtrain b4, host syncs as before", "llama-b4-syncs", "llama-b4"),
    # a small model, where launch overhead and syncs weigh most (its own FLOPs per token: no
    # counted MFU here, the logged one is)
    ("gpt2-124m b16", "gpt2-run", None),
    ("gpt2-124m b16, host syncs as before", "gpt2-syncs", "gpt2-run"),
)
# rows of another model than the llama-1b whose FLOPs per token the counted MFU uses
OTHER_MODEL_STEPS = ("gpt2-run", "gpt2-syncs")
STEPS = tuple(step for _, step, _ in ROWS)


def peak_flops(environment: dict, steps: dict) -> float | None:
    """One peak for every row's counted MFU: TorchTitan's own where it ran, else by GPU name."""
    for name in ("torchtitan-b4", "torchtitan-b8"):
        if peak := steps.get(name, {}).get("figures", {}).get("peak_flops"):
            return peak
    gpu = str(environment.get("gpu") or "")
    return next((t * 1e12 for key, t in PEAK_TFLOPS.items() if key in gpu), None)


def measured(step: dict | None) -> dict | None:
    """The figures a row shows, or None where the step did not pass."""
    if not step or step["status"] != "passed" or "tokens_per_s" not in step["figures"]:
        return None
    f = step["figures"]
    if step["name"].startswith("torchtitan"):
        return {
            "tokens_per_s": f["tokens_per_s"],
            "mfu": f.get("mfu"),
            "reserved_gib": f.get("peak_reserved_gib"),
            "allocated_gib": None,
        }
    return {
        "tokens_per_s": f.get("steady_tokens_per_s", f["tokens_per_s"]),
        "mfu": f.get("steady_mfu", f.get("mfu")),
        "reserved_gib": f.get("reserved_gib"),
        "allocated_gib": f.get("peak_gib"),
    }


def why_not(name: str, steps: dict) -> str:
    step = steps.get(name)
    if step is None:
        return "not run: not among this report's steps (--only)"
    if step["status"] == "passed":  # a dry run's float8 only validates; or unreadable figures
        error = step["figures"].get("error", "it measures nothing in this mode")
        return f"not measured: {name} passed without figures ({error})"
    return f"not run: {name} {step['status']}" + (f" ({step['reason']})" if step["reason"] else "")


def table(steps: dict, environment: dict) -> dict:
    """Rows with ratios and the goals, from the report's steps by name (a merged report's steps
    carry `call`: ratios across two calls are marked)."""
    peak = peak_flops(environment, steps)
    rows = []
    for label, name, reference in ROWS:
        row = {"row": label, "step": name, "reference": reference}
        figures = measured(steps.get(name))
        if figures is None:
            rows.append({**row, "status": why_not(name, steps)})
            continue
        row.update(figures, status="measured")
        if peak and name not in OTHER_MODEL_STEPS:
            row["mfu_counted"] = figures["tokens_per_s"] * FLOPS_PER_TOKEN / peak
        ref = measured(steps.get(reference)) if reference else None
        if ref:
            row["ratio"] = figures["tokens_per_s"] / ref["tokens_per_s"]
            if steps[name].get("call") != steps[reference].get("call"):
                row["across_calls"] = True
        rows.append(row)
    by_step = {r["step"]: r for r in rows}
    return {
        "rows": rows,
        "goals": goals(by_step, steps),
        "flops_per_token": FLOPS_PER_TOKEN,
        "peak_flops": peak,
    }


def goals(rows: dict, steps: dict) -> list[dict]:
    """Each goal passed, failed, or not run (with why) where a row it needs was not measured."""

    def judged(goal: str, needs: tuple[str, ...], value: float | None, passed) -> dict:
        if missing := [n for n in needs if rows[n]["status"] != "measured"]:
            return {"goal": goal, "status": "not run", "reason": why_not(missing[0], steps)}
        if value is None:
            return {"goal": goal, "status": "not run", "reason": "a figure it needs is missing"}
        return {"goal": goal, "status": "pass" if passed(value) else "fail", "value": value}

    out = []
    for b in (4, 8):
        ours, tt = rows[f"llama-b{b}"], rows[f"torchtitan-b{b}"]
        needs = (ours["step"], tt["step"])
        out.append(
            judged(
                f"b{b}: llmtrain tokens/s >= {GOAL_TT:.1f}x TorchTitan's",
                needs,
                ours.get("ratio"),
                lambda v: v >= GOAL_TT,
            )
        )
        out.append(
            judged(
                f"b{b}: llmtrain peak memory (reserved) <= TorchTitan's",
                needs,
                quotient(ours.get("reserved_gib"), tt.get("reserved_gib")),
                lambda v: v <= 1.0,
            )
        )
    out.append(
        judged(
            f"doc masking: >= {GOAL_DOC_MASKING} of the unmasked run's tokens/s (b4)",
            ("llama-b4-docmask", "llama-b4"),
            rows["llama-b4-docmask"].get("ratio"),
            lambda v: v >= GOAL_DOC_MASKING,
        )
    )
    ours = rows["llama-b4"]
    out.append(
        judged(
            f"MFU in metrics.jsonl = counted at {FLOPS_PER_TOKEN / 1e9:.2f}e9 FLOP/token (b4)",
            ("llama-b4",),
            quotient(ours.get("mfu"), ours.get("mfu_counted")),
            lambda v: abs(v - 1) <= MFU_TOLERANCE,
        )
    )
    return out


def quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def markdown(doc: dict, dry: bool) -> list[str]:
    lines = ["## Side by side with TorchTitan 0.2.2 (llama-1b tied, seq 2048, one GPU)", ""]
    if dry:
        lines += ["Dry run: CPU figures of tiny models; the goals are not judged on them.", ""]
    lines += [
        f"tokens/s: mean over the logged windows ending at step >= {STEADY_FROM} (steps 11-40, "
        "TorchTitan's TT_SUMMARY); MFU counted: tokens/s x "
        f"{FLOPS_PER_TOKEN:.4g} FLOP/token / {fmt(doc['peak_flops'], '{:.4g}')} FLOP/s for every "
        "row; peak GiB: the allocator's peak reserved (TorchTitan's `memory:`) and, for "
        "llmtrain, peak allocated in parentheses.",
        "",
        "| run | step | tokens/s | MFU (as logged) | MFU counted | peak GiB | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if r["status"] != "measured":
            lines.append(f"| {r['row']} | {r['step']} | {r['status']} | | | | |")
            continue
        memory = fmt(r.get("reserved_gib"), "{:.1f}")
        if r.get("allocated_gib") is not None:
            memory += f" ({r['allocated_gib']:.1f})"
        ratio = ""
        if "ratio" in r:
            ratio = f"{r['ratio']:.3f} of {r['reference']}"
            ratio += " (another call)" if r.get("across_calls") else ""
        lines.append(
            f"| {r['row']} | {r['step']} | {r['tokens_per_s']:,.0f} | {fmt(r['mfu'], '{:.1%}')} "
            f"| {fmt(r.get('mfu_counted'), '{:.1%}')} | {memory} | {ratio} |"
        )
    lines += ["", "| goal | result |", "|---|---|"]
    for g in doc["goals"]:
        result = "not judged (dry run)" if dry and g["status"] != "not run" else g["status"]
        detail = f"{g['value']:.3f}" if "value" in g else g.get("reason", "")
        lines.append(f"| {g['goal']} | {result}{': ' + detail if detail else ''} |")
    return lines


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


# ------------------------------------------------------------------------------ command line
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-torchtitan", help="is the bundle's torchtitan/ complete")
    check.add_argument("folder", type=Path)
    stage = sub.add_parser("stage-torchtitan", help="a dry run's copy for another Python")
    stage.add_argument("source", type=Path)
    stage.add_argument("dest", type=Path)
    stage.add_argument("--python-version", help="e.g. 3.11 (default: this Python's)")
    args = p.parse_args()
    if args.command == "check-torchtitan":
        if problems := check_torchtitan(args.folder):
            print(f"{args.folder} is not a complete TorchTitan folder (bundle.sh builds it):")
            print("\n".join(f"  {problem}" for problem in problems))
            return 1
        print(f"{args.folder}: every file and wheel the torchtitan steps need is there")
        return 0
    version = sys.version_info[:2]
    if args.python_version:
        version = tuple(map(int, args.python_version.split(".")[:2]))
    stage_torchtitan(args.source, args.dest, version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
