"""The GPU kit's runner: install the bundle, print the environment, run every owed CUDA check
and benchmark in order (each under its own time budget, so one failure costs only itself), and
write one report (report.md + report.json) under --out.

    python tools/gpu/runner.py --bundle .gpu-bundle --out "$OUT"         # on the GPU machine
    python tools/gpu/runner.py --dry-run --out /tmp/gpu-dry              # on CPU: parse + start
    python tools/gpu/runner.py --merge A/report.json B/report.json --out DIR   # two calls, one table

--dry-run runs each step's command in a CPU form that proves it parses and starts (configs
validated as written for the GPU, then run for two steps on CPU with a tiny model; benchmarks
at tiny sizes; the gpu tests collected), so a GPU session never dies on a typo. Without a
bundle folder it installs wheels built here from the repo, offline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import side_by_side as sbs
import steps as kit
from packaging.specifiers import SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
TAIL_CHARS = 4000


@dataclass
class Result:
    name: str
    measures: str
    status: str  # passed, failed, timeout, skipped (known not to apply), not run (out of time)
    seconds: float = 0.0
    budget_s: int = 0
    commands: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    reason: str = ""
    tail: str = ""


# ------------------------------------------------------------------------------ installing
def local_wheels(dest: Path) -> list[Path]:
    """Wheels of every package and plugin built from the repo, offline: pip with hatchling
    where this Python has both, else uv from its cache (what the nox venvs were built with)."""
    sources = [*sorted((ROOT / "packages").glob("*/")), ROOT, *kit.bundled_plugins()]
    if importlib.util.find_spec("pip") and importlib.util.find_spec("hatchling"):
        wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        subprocess.run([*wheel, "--no-index", "-w", str(dest), *map(str, sources)], check=True)
    else:
        for source in sources:
            uv = ["uv", "build", "-q", "--wheel", "--offline", "-o", str(dest), str(source)]
            subprocess.run(uv, check=True)
    return sorted(dest.glob("*.whl"))


def installable_here(wheels: list[Path]) -> list[Path]:
    """The dry run's Python may not be the GPU machine's 3.12: its compiled wheels (cp312) are
    left out here, and what they provide comes from this environment."""
    supported = set(sys_tags())
    usable = [
        w for w in wheels if supported & parse_wheel_filename(w.name)[3] and admits_this_python(w)
    ]
    for wheel in sorted(set(wheels) - set(usable)):
        print(f"dry run: {wheel.name} does not install on this Python; left out")
    return usable


def admits_this_python(wheel: Path) -> bool:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    wanted = re.search(r"^Requires-Python: (.+)$", metadata, re.MULTILINE)
    return wanted is None or platform.python_version() in SpecifierSet(wanted.group(1).strip())


def install_command(wheels: list[Path], site: Path) -> list[str]:
    """pip where this Python has it (the GPU machine's does), else uv (the nox venvs)."""
    if importlib.util.find_spec("pip"):
        head = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--no-compile"]
    else:
        head = ["uv", "pip", "install", "-q", "--python", sys.executable]
    return [*head, "--no-index", "--no-deps", "--target", str(site), *map(str, wheels)]


# ------------------------------------------------------------------------------ environment
def environment() -> dict:
    """GPU, driver, torch and CUDA versions, as this machine reports them."""
    env = {"python": sys.version.split()[0], "nvidia_smi": nvidia_smi()}
    probe = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({"
        "'torch': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': c,"
        "'gpu': torch.cuda.get_device_name() if c else None,"
        "'gpu_count': torch.cuda.device_count()}))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    env.update(json.loads(proc.stdout) if proc.returncode == 0 else {"torch": proc.stderr[-500:]})
    return env


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "not found (no NVIDIA driver on this machine)"
    query = "--query-gpu=name,driver_version,memory.total"
    proc = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    )
    return (proc.stdout or proc.stderr).strip()


# ------------------------------------------------------------------------------ running
def run_step(step: kit.Step, env: dict, logs: Path, out_dir: Path, time_left: float) -> Result:
    result = Result(step.name, step.measures, "passed", budget_s=step.budget_s)
    result.commands = [" ".join(map(str, c)) for c in step.commands]
    if step.skip:
        result.status, result.reason = "skipped", step.skip
        return result
    budget = min(step.budget_s, time_left)
    if budget < 10:
        result.status, result.reason = "not run", "no time left under --time-limit"
        return result
    log = logs / f"{step.name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        for command in step.commands:
            remaining = budget - (time.perf_counter() - started)
            status = run_command(command, env, out, remaining)
            if status != "passed":
                result.status = status
                break
    result.seconds = round(time.perf_counter() - started, 1)
    keep(step, out_dir)
    if result.status == "passed" and step.checks_only:
        result.status, result.reason = "skipped", step.checks_only
    elif result.status == "passed":
        result.figures = read_figures(step)
    else:
        result.tail = log.read_text()[-TAIL_CHARS:]
        if result.status == "timeout":
            result.reason = f"over its budget of {budget:.0f} s"
    return result


def keep(step: kit.Step, out_dir: Path) -> None:
    """What the step leaves for the report's folder (a run's metrics), so it comes back."""
    for path in step.keep:
        if path.is_file():
            (out_dir / step.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out_dir / step.name / path.name)


def run_command(command: list[str], env: dict, out, timeout: float) -> str:
    out.write(f"$ {' '.join(map(str, command))}\n")
    out.flush()
    try:
        proc = subprocess.Popen(
            list(map(str, command)),
            cwd=ROOT,
            # the seconds it may take: a command that bounds itself (run_tt.sh) ends on its own
            # terms, with its summary written, rather than being killed
            env={**env, "GPU_KIT_BUDGET_S": str(int(max(timeout, 1)))},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a timeout ends the command's whole process group
        )
        rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        out.write(f"\n[runner] timed out after {timeout:.0f} s\n")
        return "timeout"
    except OSError as err:  # a command that does not exist
        out.write(f"\n[runner] could not start: {err}\n")
        return "failed"
    out.write(f"[runner] exit status {rc}\n")
    return "passed" if rc == 0 else "failed"


def read_figures(step: kit.Step) -> dict:
    try:
        return step.figures() if step.figures else {}
    except (OSError, ValueError, KeyError) as err:
        return {"error": f"could not read the figures: {err}"}


# ------------------------------------------------------------------------------ reporting
def side_by_side(steps: list[dict], environment: dict) -> dict:
    """Our `llmtrain run` against the bare loop on the same model, steps and data; and the
    table against TorchTitan (side_by_side.py)."""
    by_name = {s["name"]: s for s in steps}
    ours, bare = by_name.get("llama-b4"), by_name.get("bare-loop")
    if (
        ours
        and bare
        and ours["figures"].get("tokens_per_s")
        and bare["figures"].get("tokens_per_s")
    ):
        ratio = ours["figures"]["tokens_per_s"] / bare["figures"]["tokens_per_s"]
        bare_loop = {
            "ratio_to_bare": round(ratio, 4),
            "goal": kit.GOAL_RATIO,
            "met": ratio >= kit.GOAL_RATIO,
        }
    else:
        bare_loop = {"ratio_to_bare": None, "note": "llama-b4 or the bare loop did not pass"}
    return {
        "bare_loop": bare_loop,
        "moe_vs_dense": moe_vs_dense(by_name),
        "long_context": long_context(by_name),
        "torchtitan": sbs.table(by_name, environment),
    }


def moe_vs_dense(by_name: dict[str, dict]) -> dict:
    """MoE MFU (counted on active parameters: the top-k experts' FLOPs per token) over the MFU
    of the dense model of equal active FLOPs, against issue 39's goal; both FLOP counts shown,
    since the ratio means what it says only where they are (nearly) equal."""
    moe, dense = by_name.get("moe-olmoe"), by_name.get("dense-olmoe-active")
    figures = {n: s["figures"] for n, s in (("moe", moe), ("dense", dense)) if s}
    if len(figures) < 2 or not all(f.get("mfu") for f in figures.values()):
        missing = [n for n, s in (("moe-olmoe", moe), ("dense-olmoe-active", dense)) if not s]
        why = f"{', '.join(missing)} not run" if missing else "no MFU from moe-olmoe or its dense"
        return {"ratio": None, "goal": kit.GOAL_MOE_RATIO, "note": why}
    ratio = figures["moe"]["mfu"] / figures["dense"]["mfu"]
    result = {
        "ratio": round(ratio, 4),
        "goal": kit.GOAL_MOE_RATIO,
        "met": ratio >= kit.GOAL_MOE_RATIO,
    }
    for side, f in figures.items():
        result[f"{side}_mfu"] = f["mfu"]
        result[f"{side}_tokens_per_s"] = f["tokens_per_s"]
        result[f"{side}_flops_per_token"] = f.get("flops_per_token")
    return result


def long_context(by_name: dict[str, dict]) -> list[dict]:
    """Per pair of steps.LONG_PAIRS (sliding window against full causal, CP doc masking against
    CP causal, seq 8192): tokens/s, MFU (as logged: the model's FLOPs per token, which count
    min(T, window) keys per query in a local block), FLOPs per token and peak memory of both
    runs, the ratio of their tokens/s and of their MFUs; a note where one did not pass."""
    pairs = []
    for label, name, reference in kit.LONG_PAIRS:
        pair: dict = {"label": label, "step": name, "reference": reference}
        missing = [why for n in (name, reference) if (why := not_measured(n, by_name.get(n)))]
        if missing:
            pairs.append({**pair, "ratio": None, "note": "; ".join(missing)})
            continue
        ours, ref = by_name[name]["figures"], by_name[reference]["figures"]
        pair["ratio"] = round(ours["tokens_per_s"] / ref["tokens_per_s"], 4)
        if ours.get("mfu") and ref.get("mfu"):
            pair["mfu_ratio"] = round(ours["mfu"] / ref["mfu"], 4)
        for side, figures in (("step", ours), ("reference", ref)):
            for key in ("tokens_per_s", "mfu", "flops_per_token", "peak_gib", "reserved_gib"):
                pair[f"{side}_{key}"] = figures.get(key)
        if by_name[name].get("call") != by_name[reference].get("call"):
            pair["across_calls"] = True
        pairs.append(pair)
    return pairs


def not_measured(name: str, step: dict | None) -> str:
    """Why a step has no tokens/s to compare ("" where it has)."""
    if step is None:
        return f"{name} not run"
    if step["status"] != "passed":
        return f"{name} {step['status']}" + (f" ({step['reason']})" if step["reason"] else "")
    if not step["figures"].get("tokens_per_s"):
        return f"{name} passed without tokens/s ({step['figures'].get('error', 'no figures')})"
    return ""


def long_context_markdown(pairs: list[dict], dry: bool) -> list[str]:
    lines = ["## Long context: sliding window and CP document masking (llama-1b, seq 8192)", ""]
    if dry:
        lines += [
            f"Dry run: CPU figures of the tiny model at seq 32 (window {kit.CPU_WINDOW}).",
            "",
        ]
    lines += [
        "tokens/s and MFU: the median of the logged windows after the first (compilation); MFU "
        "as logged, with the FLOPs per token the model reports (a local block counts "
        "min(T, window) keys per query, so the window run's MFU is on fewer FLOPs); peak GiB: "
        "allocated (reserved).",
        "",
        "| runs | tokens/s ratio | MFU ratio | run | tokens/s | MFU | FLOP/token | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        if p["ratio"] is None:
            lines.append(f"| {p['label']} | not measured: {p['note']} | | | | | | |")
            continue
        value = f"{p['ratio']:.3f}" + (" (another call)" if p.get("across_calls") else "")
        mfu_ratio = sbs.fmt(p.get("mfu_ratio"), "{:.3f}")
        for first, side in ((True, "step"), (False, "reference")):
            memory = sbs.fmt(p[f"{side}_peak_gib"], "{:.1f}")
            if p[f"{side}_reserved_gib"] is not None:
                memory += f" ({p[f'{side}_reserved_gib']:.1f})"
            head = f"| {p['label']} | {value} | {mfu_ratio} |" if first else "| | | |"
            lines.append(
                f"{head} {p[side]} | {p[f'{side}_tokens_per_s']:,.0f} "
                f"| {sbs.fmt(p[f'{side}_mfu'], '{:.1%}')} "
                f"| {sbs.fmt(p[f'{side}_flops_per_token'], '{:.4g}')} | {memory} |"
            )
    return lines


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# GPU kit report ({report['mode']})", "", "## Environment", ""]
    lines += [f"- {key}: {value}" for key, value in report["environment"].items()]
    lines += ["", "## Checks", "", "| step | status | seconds | figures | measures |"]
    lines += ["|---|---|---|---|---|"]
    for r in report["steps"]:
        figures = ", ".join(f"{k} {format_figure(v)}" for k, v in r["figures"].items())
        status = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
        lines.append(f"| {r['name']} | {status} | {r['seconds']} | {figures} | {r['measures']} |")
    lines += ["", *sbs.markdown(report["side_by_side"]["torchtitan"], "dry-run" in report["mode"])]
    lines += ["", "## llmtrain against its bare loop", ""]
    lines.append(f"`llmtrain run` / bare loop (llama-b4): {report['side_by_side']['bare_loop']}")
    lines += ["", "## MoE against a dense model of equal active FLOPs", ""]
    lines.append(
        f"MoE MFU / dense MFU (moe-olmoe / dense-olmoe-active): {report['side_by_side']['moe_vs_dense']}"
    )
    lines += [
        "",
        *long_context_markdown(report["side_by_side"]["long_context"], "dry-run" in report["mode"]),
    ]
    for r in report["steps"]:
        if r["tail"]:
            lines += ["", f"## Tail of {r['name']}", "", "```", r["tail"], "```"]
    return "\n".join(lines) + "\n"


def format_figure(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-report")))
    p.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    p.add_argument("--dry-run", action="store_true", help="CPU: prove every step parses, starts")
    p.add_argument("--only", help="comma-separated step names (install and data always run)")
    p.add_argument("--time-limit", type=float, default=float("inf"), help="seconds, all steps")
    p.add_argument("--break", dest="broken", default="", help="steps made to fail (tests)")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="REPORT_JSON",
        help="write one report (--out) from the report.json of several calls; a step in a later "
        "one replaces the same step of an earlier one",
    )
    return p.parse_args()


def chosen(plan: list[kit.Step], args: argparse.Namespace) -> list[kit.Step]:
    names = {s.name for s in plan}
    wanted = set(args.only.split(",")) if args.only else names
    wanted |= {"install", "data"}
    if unknown := (wanted | set(filter(None, args.broken.split(",")))) - names:
        raise SystemExit(f"unknown step(s) {sorted(unknown)}; steps: {', '.join(sorted(names))}")
    broken = set(args.broken.split(","))
    return [kit.broken(s) if s.name in broken else s for s in plan if s.name in wanted]


def merge(reports: list[Path], out: Path) -> int:
    """One report from several calls' (one device call is at most 10 minutes, so the
    side-by-side takes two): the steps of each, marked with their call, and the table again."""
    docs = [json.loads(path.read_text()) for path in reports]
    steps = {}
    for call, doc in enumerate(docs, 1):
        for step in doc["steps"]:
            steps[step["name"]] = {**step, "call": call}
    environment = dict(docs[0]["environment"])
    for call, doc in enumerate(docs[1:], 2):
        if doc["environment"] != docs[0]["environment"]:
            environment[f"call {call}"] = doc["environment"]
    report = {
        "mode": "+".join(sorted({d["mode"] for d in docs})),
        "merged_from": [str(p) for p in reports],
        "environment": environment,
        "steps": list(steps.values()),
    }
    report["side_by_side"] = side_by_side(report["steps"], environment)
    write_report(out, report)
    print(f"report: {out / 'report.md'}")
    return 0


def main() -> int:
    args = parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-kit-"))
    machine = environment()
    ctx = kit.Context(
        root=ROOT,
        work=work,
        python=sys.executable,
        dry=args.dry_run,
        out=args.out,
        bundle=args.bundle,
        gpus=int(machine.get("gpu_count") or 0),
    )
    for folder in (ctx.site, ctx.logs, ctx.configs, ctx.data.parent):
        folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(args.bundle.glob("*.whl")) if args.bundle.is_dir() else []
    if not wheels and args.dry_run:
        wheels = local_wheels(work / "wheels")
    if args.dry_run:
        wheels = installable_here(wheels)
    plan = kit.plan(ctx, install_command(wheels, ctx.site), bundle=str(args.bundle))
    if args.list:
        print("\n".join(f"{s.name}: {s.measures}" for s in plan))
        return 0
    # the installed bundle comes first on the path, before anything installed in this Python
    env = {**os.environ, "PYTHONPATH": str(ctx.site), "PYTHONUNBUFFERED": "1"}
    report = {"mode": "dry-run" if args.dry_run else "gpu", "environment": machine}
    print(json.dumps(report["environment"], indent=2), flush=True)
    deadline = time.monotonic() + args.time_limit
    results = []
    for step in chosen(plan, args):
        print(f"== {step.name}: {step.measures}", flush=True)
        results.append(run_step(step, env, ctx.logs, args.out, deadline - time.monotonic()))
        print(
            f"   {results[-1].status} in {results[-1].seconds} s {results[-1].figures}", flush=True
        )
    report["steps"] = [vars(r) for r in results]
    report["side_by_side"] = side_by_side(report["steps"], report["environment"])
    write_report(args.out, report)
    for pair in report["side_by_side"]["long_context"]:  # where only the output is read
        if any(s["name"] in (pair["step"], pair["reference"]) for s in report["steps"]):
            print(
                f"long context: {pair['label']}: tokens/s ratio {pair['ratio']}"
                f", MFU ratio {pair.get('mfu_ratio')}"
                + (f" ({pair['note']})" if pair.get("note") else "")
            )
    print(f"report: {args.out / 'report.md'}")
    return 0 if all(r.status in ("passed", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
