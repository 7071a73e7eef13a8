"""How long `llmtrain hf import` and `llmtrain hf export` take for a tiny model, and where the
time goes: python tools/bench_hf_startup.py [--rounds 5] [--profile].

For a model this small (a Llama of ~100k parameters with a 300-token BPE tokenizer, made here:
nothing is downloaded) the commands' time is their start: imports, not tensors. Each round runs,
as fresh processes in rotating order, the two commands on the same directories (import of a
transformers directory with its tokenizer into a checkpoint; export of that checkpoint, tokenizer
included) and two references measured in the same run: `python -c "import torch"` (the floor of
any command that reads or writes tensors) and `llmtrain --help` (the command line with every
plugin loaded). Medians are reported, with each command's seconds over the torch floor.

Every timed process runs the command under an audit hook that records network use
(socket.connect, socket.getaddrinfo: none is expected) and which heavy modules it imported
(transformers, torch._dynamo, scipy, ...): the line under the timings.

`--profile` adds, for one run of each command, the modules whose import took longest
(`python -X importtime`, cumulative, top level and one level down) and cProfile's top entries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = (
    "transformers",
    "transformers.modeling_utils",
    "torch._dynamo",
    "scipy",
    "sklearn",
    "torch.distributed.checkpoint",
    "tokenizers",
)

# runs `llmtrain ARGS...` in this process with an audit hook for network use; reports on stderr
WRAPPER = """
import json, sys
network = []
def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo"):
        network.append(event)
sys.addaudithook(hook)
from llmtrain.core_mesh.cli import main
try:
    code = main(sys.argv[1:])
finally:
    heavy = [m for m in HEAVY if m in sys.modules]
    source = getattr(sys.modules.get("llmtrain_hf"), "__file__", None)
    report = {"network": network, "modules": heavy, "llmtrain_hf": source}
    sys.stderr.write("BENCH " + json.dumps(report) + "\\n")
sys.exit(code)
""".replace("HEAVY", repr(HEAVY))


def make_hf_dir(path: Path) -> None:
    """A random tiny Llama as transformers saves it, with a byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    from llmtrain.data_pack.tokenizer import train_bpe

    hf_logging.set_verbosity_error()
    words = "the cat dog sat on a mat and ran far away from home while birds sang".split()
    rng = __import__("random").Random(0)
    sentences = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]
    tokenizer_json = train_bpe(sentences, 300, special_tokens=("<|endoftext|>",))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="<|endoftext|>"
    )
    fast.save_pretrained(path)


def timed(cmd: list[str], env: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    report = {}
    for line in done.stderr.splitlines():
        if line.startswith("BENCH "):
            report = json.loads(line.removeprefix("BENCH "))
    return seconds, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--profile", action="store_true", help="import times and cProfile too")
    parser.add_argument(
        "--before",
        metavar="SRC",
        help="a directory holding another llmtrain_hf package (an older version, say: "
        "`git archive REV plugins/llmtrain-hf/src | tar -x -C /tmp/old`, then "
        "/tmp/old/plugins/llmtrain-hf/src); its import and export are timed in the same rounds",
    )
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-hf-"))
    hf_dir, ckpt, out = root / "hf", root / "ckpt", root / "out"
    make_hf_dir(hf_dir)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    py = sys.executable
    llmtrain = [py, "-c", WRAPPER]
    commands = {
        "import torch": [py, "-c", "import torch"],
        "llmtrain --help": [*llmtrain, "--help"],
        "hf import": [*llmtrain, "hf", "import", str(hf_dir), "-o", str(ckpt)],
        "hf export": [*llmtrain, "hf", "export", str(ckpt), "-o", str(out), "--overwrite"],
    }

    envs = {name: env for name in commands}
    if args.before:
        before = {**env, "PYTHONPATH": os.pathsep.join([args.before, env.get("PYTHONPATH", "")])}
        for name in ("hf import", "hf export"):
            commands[f"{name} (before)"] = commands[name]
            envs[f"{name} (before)"] = before

    def run(name: str) -> tuple[float, dict]:
        if name.startswith("hf import"):
            subprocess.run(["rm", "-rf", str(ckpt)], check=True)
        return timed(commands[name], envs[name])

    run("hf import")  # the checkpoint export reads, and a warm page cache for every command
    run("hf export")
    times: dict[str, list[float]] = {name: [] for name in commands}
    reports: dict[str, dict] = {}
    names = list(commands)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        # an export reads the checkpoint an import wrote: imports first
        order = sorted(order, key=lambda n: n.startswith("hf export"))
        for name in order:
            seconds, report = run(name)
            times[name].append(seconds)
            reports[name] = report

    floor = statistics.median(times["import torch"])
    print(f"{args.rounds} rounds, medians (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name:20s} {median:6.2f} s   {median / floor:5.2f} x import torch")
    if args.before:
        for name in ("hf import", "hf export"):
            ratio = statistics.median(times[f"{name} (before)"]) / statistics.median(times[name])
            print(f"  {name:20s} {ratio:6.2f} x faster than before")
    for name in names[1:]:
        report = reports[name]
        print(
            f"  {name:20s} network calls: {len(report['network'])}; "
            f"imported: {', '.join(report['modules']) or 'none of ' + ', '.join(HEAVY)}"
        )
        if name.endswith("(before)"):
            print(f"  {'':20s} llmtrain_hf from {report['llmtrain_hf']}")

    if args.profile:
        for name in ("hf import", "hf export"):
            if name == "hf import":
                subprocess.run(["rm", "-rf", str(ckpt)], check=True)
            profile(name, commands[name][3:], env, root)
            if name == "hf import":  # again, for the export's profile and cProfile's run
                subprocess.run(["rm", "-rf", str(ckpt)], check=True)
                timed(commands[name], env)


def profile(name: str, argv: list[str], env: dict, root: Path) -> None:
    """The slowest imports (-X importtime, cumulative) and cProfile's top entries of one run of
    `llmtrain ARGV...` (an import writes its checkpoint in the first, over it in the second)."""
    import pstats

    py = sys.executable
    done = subprocess.run(
        [py, "-X", "importtime", "-m", "llmtrain", *argv], capture_output=True, text=True, env=env
    )
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, module = line.split("|")
        depth = (len(module) - len(module.lstrip()) - 1) // 2
        if cumulative.strip().isdigit() and depth <= 1:
            rows.append((int(cumulative) / 1e6, "  " * depth + module.strip()))
    print(f"\n{name}: slowest imports (cumulative s; top level, and one level below)")
    for seconds, module in sorted(rows, reverse=True)[:15]:
        print(f"  {seconds:6.2f}  {module}")
    if name == "hf import":
        subprocess.run(["rm", "-rf", argv[argv.index("-o") + 1]], check=True)
    stats = root / f"{name.replace(' ', '-')}.prof"
    cmd = [py, "-m", "cProfile", "-o", str(stats), "-m", "llmtrain", *argv]
    subprocess.run(cmd, capture_output=True, env=env, check=True)
    print(f"{name}: cProfile, cumulative")
    pstats.Stats(str(stats)).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
