"""Interrupt `llmtrain data pack` at random moments and check that nothing half-written stays.

Each trial starts the real command (2 workers, the reference encoder, small input ranges) on a
generated JSONL corpus, sends it SIGINT at a random moment (before or while its workers start,
while they are busy, near the commit), waits for the process and every process it had started to
be gone, and then checks the output's directory: no `<output>.tmp-<id>` staging directory, and the
output either a complete dataset (the pack finished before the signal) or absent. `--load N`
keeps N busy loops running meanwhile (a loaded machine is where a late write shows).

    python tools/stress_pack_interrupt.py --trials 100 --load 3
    python tools/stress_pack_interrupt.py --trials 60 --load 3 --chunk-tokens 1024  # many writes

Half the trials signal the process (as the tests do), half its process group (as Ctrl-C in a
terminal does, reaching the workers too). Exits 1 if any trial left something behind (each such
trial is printed with what it left); an exit code other than 0, 130 with "interrupted", or the
signal's own (the signal came before the command's code ran) is counted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SCRIPT = (
    "import faulthandler, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "from llmtrain.core_mesh.cli import main; raise SystemExit(main())"
)
WORDS = (
    "hello world the of and data token packing naïve café über 日本語 Привет 😀 x² can't".split()
)


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    lines = []
    for _ in range(300):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 40))]
        lines.append(json.dumps({"text": " ".join(words)}, ensure_ascii=False) + "\n")
    block = "".join(lines).encode()
    repeats = int(megabytes * (1 << 20)) // len(block) + 1
    path.write_bytes(block * repeats)
    return 300 * repeats


def make_tokenizer(path: Path) -> None:
    from llmtrain.data_pack.tokenizer import train_bpe

    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(2000)]
    path.write_text(train_bpe(texts, 400), encoding="utf-8")


def start(work: Path, data: Path, tokenizer: Path, chunk_tokens: int) -> subprocess.Popen:
    """The command in a process group of its own (which Ctrl-C in a terminal signals whole)."""
    argv = [
        sys.executable, "-c", SCRIPT, "data", "pack", str(data), "-o", str(work / "ds"),
        "--tokenizer", str(tokenizer), "--tokenizer-option", "fast=off", "--workers", "2",
        "--split-mb", "0.1", "--chunk-tokens", str(chunk_tokens), "--no-progress",
        "--log-dir", str(work / "logs"),
    ]  # fmt: skip
    out = open(work / "stderr.txt", "wb")
    try:
        return subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True
        )
    finally:
        out.close()


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def leftovers(work: Path) -> list[str]:
    return sorted(n for n in os.listdir(work) if n.startswith("ds.tmp-") or n.startswith("ds.old-"))


def output_state(work: Path, documents: int) -> str:
    """'absent', 'complete', or what is wrong with the output."""
    from llmtrain.data_pack.errors import DatasetError
    from llmtrain.data_pack.store import PackedDataset

    out = work / "ds"
    if not out.exists():
        return "absent"
    try:
        ds = PackedDataset(str(out))
    except DatasetError as exc:
        return f"incomplete: {exc}"
    if ds.n_documents != documents:
        return f"incomplete: {ds.n_documents} of {documents} documents"
    return "complete"


def trial(args, work: Path, data: Path, tokenizer: Path, documents: int, delay: float) -> dict:
    chunk_tokens = args.chunk_tokens or random.choice([1 << 20, 1 << 16, 1 << 12])
    target = random.choice(["process", "group"])  # as the tests do, or as Ctrl-C in a terminal
    proc = start(work, data, tokenizer, chunk_tokens)
    parent = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and proc.poll() is None:
        for child in descendants(parent):  # every process it starts, before the signal
            seen.setdefault(child.pid, child)
        time.sleep(0.005)
    for child in descendants(parent):
        seen.setdefault(child.pid, child)
    signalled = proc.poll() is None
    if signalled:
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait()
        code = "hung"
    at_exit = leftovers(work)  # the moment the main process is gone
    _, alive = psutil.wait_procs(list(seen.values()), timeout=args.timeout)
    result = {
        "delay": round(delay, 3),
        "chunk_tokens": chunk_tokens,
        "target": target,
        "signalled": signalled,
        "code": code,
        "children": len(seen),
        "alive": [p.pid for p in alive],
        "at_exit": at_exit,
        "left": leftovers(work),
        "output": output_state(work, documents),
    }
    stderr = (work / "stderr.txt").read_text(errors="replace")
    result["interrupted"] = "interrupted" in stderr
    # what must hold whatever the moment: nothing left running, no temporary, and the output
    # complete or absent (complete only if the pack may have finished)
    result["clean"] = (
        not result["alive"]
        and not result["left"]
        and (
            result["output"] == "absent"
            or (result["output"] == "complete" and (code == 0 or signalled))
        )
        and not (code == 0 and result["output"] != "complete")
    )
    # 130: the command's own "interrupted"; -SIGINT: the signal came before the command's code
    # ran (Python re-raises an uncaught KeyboardInterrupt as the signal)
    result["expected_code"] = code in (0, -signal.SIGINT) or (code == 130 and result["interrupted"])
    if not (result["clean"] and result["expected_code"]):
        result["stderr"] = stderr[-3000:]
    for p in alive:
        p.kill()
    return result


def load(n: int, seconds: float) -> list[subprocess.Popen]:
    """n busy loops, each ending after `seconds` or once this script is gone."""
    loop = (
        f"import os, time\nend = time.monotonic() + {seconds}\n"
        f"while time.monotonic() < end and os.getppid() == {os.getpid()}: pass"
    )
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--megabytes", type=float, default=4.0, help="corpus size")
    parser.add_argument("--load", type=int, default=2, help="busy loops running meanwhile")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="the pack's chunk size (default: one of 2^20, 2^16, 2^12 per trial); small chunks "
        "mean many writes, so more interrupts land while zarr writes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folders")
    args = parser.parse_args()
    random.seed(args.seed)
    root = Path(tempfile.mkdtemp(prefix="stress-pack-"))
    data, tokenizer = root / "corpus.jsonl", root / "tokenizer.json"
    documents = make_corpus(data, args.megabytes)
    make_tokenizer(tokenizer)
    busy = load(args.load, seconds=6 * 3600)
    failures = odd_codes = 0
    try:
        # one uninterrupted run under the same load: how long a pack takes
        work = root / "full"
        work.mkdir()
        t0 = time.monotonic()
        full = trial(args, work, data, tokenizer, documents, delay=args.timeout)
        duration = time.monotonic() - t0
        print(f"uninterrupted: {duration:.1f} s, {full['output']}, code {full['code']}", flush=True)
        for i in range(args.trials):
            phase = i % 4
            if phase == 0:  # while the command imports and its workers start
                delay = random.uniform(0.0, 0.4 * duration)
            elif phase == 1:  # while the workers tokenize and chunks are written
                delay = random.uniform(0.3 * duration, 0.9 * duration)
            elif phase == 2:  # near the end: the last chunks, the commit
                delay = random.uniform(0.8 * duration, 1.1 * duration)
            else:  # anywhere
                delay = random.uniform(0.0, 1.1 * duration)
            work = root / f"t{i:04d}"
            work.mkdir()
            result = trial(args, work, data, tokenizer, documents, delay)
            failures += not result["clean"]
            odd_codes += not result["expected_code"]
            mark = "ok  " if result["clean"] else "FAIL"
            if result["clean"] and not result["expected_code"]:
                mark = "code"
            brief = {k: v for k, v in result.items() if k != "stderr"}
            print(f"{mark} {i:4d} {json.dumps(brief)}", flush=True)
            if "stderr" in result:
                print(result["stderr"], flush=True)
            if not args.keep and result["clean"]:
                subprocess.run(["rm", "-rf", str(work)], check=False)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(
        f"{failures} of {args.trials} trials left something behind; {odd_codes} ended with an "
        "unexpected exit code",
        flush=True,
    )
    if not args.keep and not failures:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    else:
        print(f"work folders: {root}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
