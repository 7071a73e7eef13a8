"""Pack tokens/s vs the raw tokenizer ceiling and vs Modalities: python tools/bench_pack.py [--quick] [--modalities-python PATH].

A generated English-like JSONL corpus (words of Zipf-distributed frequency, punctuation, numbers,
non-ASCII words, paragraphs; documents of log-normal length) and a GPT-2-style byte-level BPE
trained on a sample of it. With the same N processes throughout:
- ceiling: N spawned processes each batch-encode their share of the texts, already parsed in
  memory, with the same backend as pack (HF `encode_batch_hf`, and the fast tiktoken path);
- pack: `llmtrain.data_pack.pack` end to end (JSONL on disk -> committed zarr) with the default
  encoder (fast, when verified on a sample) and with `fast: off` (HF); their token ids must match;
- Modalities (with --modalities-python, a Python that has `modalities` installed): its
  `create_raw_index` then `pack_encoded_data` on the same JSONL, tokenizer.json and N; its .pbin
  token ids are compared with ours. It runs the functions its `data create_raw_index` and
  `data pack_encoded_data` commands call, timed inside its process (the wall time with the
  interpreter's start and imports is printed too).
Ceilings and packs run in interleaved rounds (medians printed; pack's ratio to its ceiling is the
median of the rounds' ratios, each round timing both back to back), with the CPU seconds they used:
the ceiling's encode loops, pack's parent and workers together. CPU time is less disturbed than
tokens/s by other load on a shared machine. Token counts include one end-of-document token per
document everywhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

GOAL_CEILING = 0.9
GOAL_MODALITIES = 2.0
EOD = "<|endoftext|>"

COMMON_WORDS = """the of and to a in is it you that he was for on are with as I his they be at one
have this from or had by not word but what some we can out other were all there when up use your
how said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no most
people my over know water than call first who may down side been now find any new work part take
get place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build
self earth father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross farm hard
start might story saw far sea draw left late run while press close night real life few north
""".split()
SYLLABLES = """ba be bi bo bu ca ce ci co da de di do du fa fe fi fo ga ge go ha he hi ho la le
li lo lu ma me mi mo mu na ne ni no nu pa pe pi po ra re ri ro ru sa se si so su ta te ti to tu
va ve vi vo wa we wi za an en in on un ar er ir or ur al el il ol ing tion ment ness ly ous ive
able ed es st th ch sh qu str pl tr""".split()
NON_ASCII = """café naïve façade Zürich Straße Größe señor niño São Paulo Kraków Dvořák Łódź
Ærøskøbing Ελλάδα αλφα Москва привет мир 東京 日本語 中文 한국어 नमस्ते مرحبا שלום
— – … € £ ¥ ° × ½ “quoted” ‘single’ 🙂 🚀 👍🏽 ✓ →""".split()  # noqa: RUF001
# a word's form: (probability, format); applied to words only, not to numbers or non-ASCII
FORMS = [
    (0.80, "{}"),
    (0.06, "{},"),
    (0.05, "{}."),
    (0.03, "{cap}"),
    (0.01, "{}'s"),
    (0.01, '"{}"'),
    (0.01, "({})"),
    (0.01, "{}?"),
    (0.005, "{}!"),
    (0.005, "{};"),
    (0.01, "{}:"),
]


# ---------------------------------------------------------------- corpus and tokenizer
def vocabulary(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Every printable item (word forms, numbers, non-ASCII words, paragraph breaks) and its
    probability: words are Zipf-distributed by rank."""
    made = ("".join(rng.choice(SYLLABLES, n)) for n in rng.integers(1, 5, 40_000))
    words = list(dict.fromkeys([*COMMON_WORDS, *made]))[:25_000]
    zipf = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    items, probs = [], []
    for p_form, form in FORMS:
        items += [form.format(w, cap=w.capitalize()) for w in words]
        probs.append(zipf / zipf.sum() * p_form * 0.93)
    numbers = [str(x) for x in rng.integers(0, 3000, 600)]
    numbers += [f"{x:,}" for x in rng.integers(1000, 10_000_000, 300)]
    numbers += [f"{x:.2f}" for x in rng.random(200) * 1000]
    numbers += [f"{x}%" for x in rng.integers(1, 100, 100)]
    for extra, share in ((numbers, 0.04), (NON_ASCII, 0.01), (["\n\n"], 0.02)):
        items += extra
        probs.append(np.full(len(extra), share / len(extra)))
    p = np.concatenate(probs)
    return np.array(items, dtype=object), p / p.sum()


def write_corpus(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A JSONL file of about `size_bytes` with {"id", "text"} documents; returns the count."""
    rng = np.random.default_rng(seed)
    items, p = vocabulary(rng)
    cumulative = np.cumsum(p)
    written = n_docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            lengths = np.clip(rng.lognormal(5.5, 1.0, 256).astype(int), 3, 40_000)
            picks = np.searchsorted(cumulative, rng.random(int(lengths.sum())) * cumulative[-1])
            words = items[picks].tolist()
            lines = []
            begin = 0
            for n in lengths.tolist():
                text = " ".join(words[begin : begin + n]).replace(" \n\n ", "\n\n").strip()
                begin += n
                if text:
                    lines.append(json.dumps({"id": n_docs, "text": text}, ensure_ascii=False))
                    n_docs += 1
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    return n_docs


def read_texts(path: Path, start: int = 0, end: int | None = None) -> list[str]:
    """Texts of the lines starting in bytes [start, end) of a JSONL file."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # a line starting before `start` belongs to the previous range
        texts = []
        while end is None or f.tell() < end:
            line = f.readline()
            if not line:
                break
            texts.append(json.loads(line)["text"])
    return texts


def train_tokenizer(corpus: Path, out: Path, vocab_size: int, sample_bytes: int) -> None:
    from llmtrain.data_pack.tokenizer import train_bpe

    out.write_text(train_bpe(read_texts(corpus, 0, sample_bytes), vocab_size), encoding="utf-8")


# ---------------------------------------------------------------- ceiling: encode in memory
def _ceiling_worker(corpus, start, end, tokenizer_path, backend, batch_docs, barrier, results):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as pack's workers: one process per core
    from llmtrain.data_pack.tokenizer import tokenizer_from_raw

    fast = "on" if backend == "fast" else "off"
    tok = tokenizer_from_raw({"kind": "hf", "path": str(tokenizer_path), "fast": fast})
    encode = tok.encode_batch if backend == "fast" else tok.encode_batch_hf
    texts = read_texts(corpus, start, end)
    encode(texts[:8])  # first-call setup outside the timing
    barrier.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    n = 0
    for begin in range(0, len(texts), batch_docs):
        batch = texts[begin : begin + batch_docs]
        n += sum(map(len, encode(batch))) + len(batch)  # + one eod per document, as pack counts
    results.put((n, t0, time.perf_counter(), time.process_time() - cpu0))


def ceiling(corpus: Path, tokenizer_path: Path, backend: str, procs: int, batch_docs: int):
    """(tokens, seconds, CPU seconds): N spawned processes encode equal byte shares of the corpus,
    timed from a common start (after parsing) to the last one's end."""
    size = corpus.stat().st_size
    bounds = [size * i // procs for i in range(procs + 1)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(
            target=_ceiling_worker,
            args=(corpus, a, b, tokenizer_path, backend, batch_docs, barrier, results),
        )
        for a, b in itertools.pairwise(bounds)
    ]
    for w in workers:
        w.start()
    got = [results.get() for _ in workers]
    for w in workers:
        w.join()
    tokens, starts, ends, cpus = zip(*got, strict=True)
    return sum(tokens), max(ends) - min(starts), sum(cpus)


# ---------------------------------------------------------------- pack (ours)
def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (pack's workers)."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def write_parquet(corpus: Path, out: Path, row_group_rows: int = 4096) -> None:
    """The JSONL corpus as Parquet ({id, text}; row groups of `row_group_rows` documents, zstd as
    the published corpora use), written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with pq.ParquetWriter(out, schema, compression="zstd") as writer, open(corpus, "rb") as f:
        while lines := list(itertools.islice(f, row_group_rows)):
            records = [json.loads(line) for line in lines]
            writer.write_table(pa.Table.from_pylist(records, schema=schema))


def run_pack(corpus: Path, out: Path, tokenizer: dict, procs: int, batch_docs: int):
    """(summary, seconds, CPU seconds of this process and the workers)."""
    from llmtrain.data_pack.pack import pack

    t0, cpu0 = time.perf_counter(), cpu_seconds()
    summary = pack([str(corpus)], str(out), tokenizer, workers=procs, batch_docs=batch_docs)
    return summary, time.perf_counter() - t0, cpu_seconds() - cpu0


def packed_tokens(out: Path) -> np.ndarray:
    import zarr

    return np.asarray(zarr.open_array(str(out / "tokens"), mode="r")[:])


# ---------------------------------------------------------------- Modalities
MODALITIES_PACK = """
import sys, time
from pathlib import Path
from modalities.api import FileExistencePolicy, create_raw_data_index, pack_encoded_data
from modalities.config.config import load_app_config_dict
src, index, config = map(Path, sys.argv[1:4])
t0 = time.perf_counter()
create_raw_data_index(src_path=src, index_path=index, file_existence_policy=FileExistencePolicy.OVERRIDE)
t1 = time.perf_counter()
pack_encoded_data(load_app_config_dict(config), FileExistencePolicy.OVERRIDE)
t2 = time.perf_counter()
print("TIMES", t1 - t0, t2 - t1)
"""


def modalities_config(corpus: Path, index: Path, pbin: Path, tokenizer_dir: Path, procs: int):
    # Modalities' PackedDatasetComponentsInstantiationModel (modalities/config/instantiation_models.py)
    return textwrap.dedent(f"""\
        settings:
          src_path: {corpus}
          dst_path: {pbin}
          index_path: {index}
          jq_pattern: .text
          num_cpus: {procs}
          eod_token: "{EOD}"
          processing_batch_size: 1000
          raw_samples_queue_size: 300
          processed_samples_queue_size: 300
        tokenizer:
          component_key: tokenizer
          variant_key: pretrained_hf_tokenizer
          config:
            pretrained_model_name_or_path: {tokenizer_dir}
            padding: false
            truncation: false
        """)


def run_modalities(python: str, corpus: Path, tokenizer_path: Path, work: Path, procs: int):
    """(index seconds, pack seconds, wall seconds incl. interpreter start, pbin path), or an
    error string saying why it could not run."""
    if not shutil.which(python) and not Path(python).exists():
        return f"{python}: no such Python"
    probe = subprocess.run(
        [python, "-c", "import modalities, transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        return f"{python} cannot import modalities: {probe.stderr.strip().splitlines()[-1:]}"
    tokenizer_dir = work / "modalities-tokenizer"  # AutoTokenizer wants a directory
    tokenizer_dir.mkdir(exist_ok=True)
    shutil.copy(tokenizer_path, tokenizer_dir / "tokenizer.json")
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD})
    )
    index, pbin, config = work / "corpus.idx", work / "corpus.pbin", work / "modalities.yaml"
    pbin.unlink(missing_ok=True)
    config.write_text(modalities_config(corpus, index, pbin, tokenizer_dir, procs))
    t0 = time.perf_counter()
    done = subprocess.run(
        [python, "-c", MODALITIES_PACK, str(corpus), str(index), str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    wall = time.perf_counter() - t0
    times = [line for line in done.stdout.splitlines() if line.startswith("TIMES")]
    if done.returncode or not times or not pbin.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        return f"modalities failed (exit {done.returncode}):\n{tail}"
    index_s, pack_s = map(float, times[0].split()[1:])
    return index_s, pack_s, wall, pbin


def read_pbin(path: Path) -> np.ndarray:
    """Token ids of a Modalities .pbin: 8-byte data length, 4-byte token size (little endian),
    the tokens, then a pickled index (EmbeddedStreamData in modalities/dataloader/create_packed_data.py)."""
    with open(path, "rb") as f:
        data_len = int.from_bytes(f.read(8), "little")
        token_size = int.from_bytes(f.read(4), "little")
        data = f.read(data_len)
    return np.frombuffer(data, dtype={1: np.uint8, 2: "<u2", 4: "<u4"}[token_size])


def compare_ids(ours: np.ndarray, theirs: np.ndarray) -> str:
    if len(ours) == len(theirs) and np.array_equal(ours, theirs):
        return f"identical ({len(ours):,} tokens)"
    n = min(len(ours), len(theirs))
    diff = np.flatnonzero(ours[:n] != theirs[:n])
    first = int(diff[0]) if len(diff) else n
    return f"DIFFER: {len(ours):,} vs {len(theirs):,} tokens, first difference at token {first:,}"


# ---------------------------------------------------------------- harness
def rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=150.0, help="JSONL size to generate")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocab size to train")
    p.add_argument("--train-mb", type=float, default=8.0, help="corpus sample to train BPE on")
    p.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batch-docs", type=int, default=512, help="documents per encode_batch call")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--modalities-python", help="a Python with `modalities` (and transformers<5)")
    p.add_argument("--workdir", help="where the temporary files go (default: the system's)")
    p.add_argument("--quick", action="store_true", help="a ~10 MB smoke run, one round")
    p.add_argument(
        "--format",
        choices=["jsonl", "parquet"],
        default="jsonl",
        help="what pack reads: the JSONL corpus, or the same documents as Parquet",
    )
    p.add_argument(
        "--rss-gb",
        type=float,
        default=0.0,
        help="also pack a Parquet corpus of this many GB (and one a tenth of it) with the CLI and "
        "print the peak RSS of its processes: memory must not grow with the input",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.corpus_mb, args.train_mb = min(args.corpus_mb, 10.0), min(args.train_mb, 2.0)
        args.rounds = 1
    # imported here, not at the top: pack's workers import this script (spawn re-runs the main
    # module's imports), and a CLI user's workers would not import logging's console stack
    from llmtrain.core_mesh.logs import configure_logging

    configure_logging(level="WARNING")  # pack's progress lines would drown the table
    with tempfile.TemporaryDirectory(prefix="bench_pack-", dir=args.workdir) as tmp:
        results = bench(args, Path(tmp))
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=2))


def fast_check_seconds(corpus: Path, tokenizer_path: Path) -> float:
    """What pack's check of the fast path costs: both encoders on its sample, in one process."""
    from llmtrain.data_pack.pack import FAST_SAMPLE_BYTES
    from llmtrain.data_pack.tokenizer import tokenizer_from_raw

    texts = read_texts(corpus, 0, FAST_SAMPLE_BYTES)
    tok = tokenizer_from_raw({"kind": "hf", "path": str(tokenizer_path)})
    t0 = time.perf_counter()
    tok.verify_fast(texts)
    return time.perf_counter() - t0


def measure_ours(args, corpus: Path, tokenizer_path: Path, work: Path, source: Path) -> dict:
    """Ceiling and pack for each backend, in interleaved rounds; medians of tokens/s and CPU s.
    The last round's packs stay in work/pack-hf and work/pack-fast."""
    specs = {
        "hf": {"kind": "hf", "path": str(tokenizer_path), "fast": "off"},
        "fast": {"kind": "hf", "path": str(tokenizer_path)},  # the default: fast once verified
    }
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    encoders: dict[str, str] = {}
    for r in range(args.rounds):
        for backend in ("hf", "fast") if r % 2 == 0 else ("fast", "hf"):
            n, s, cpu = ceiling(corpus, tokenizer_path, backend, args.procs, args.batch_docs)
            rates.setdefault(f"ceiling {backend}", []).append(rate(n, s))
            cpus.setdefault(f"ceiling {backend}", []).append(cpu)
            tokens[f"ceiling {backend}"] = n
            out = work / f"pack-{backend}"
            shutil.rmtree(out, ignore_errors=True)
            summary, wall, cpu = run_pack(source, out, specs[backend], args.procs, args.batch_docs)
            rates.setdefault(f"pack {backend}", []).append(rate(summary.tokens, wall))
            cpus.setdefault(f"pack {backend}", []).append(cpu)
            tokens[f"pack {backend}"], encoders[backend] = summary.tokens, summary.encoder
    runs = {
        name: {
            "tokens": tokens[name],
            "tokens_per_s": statistics.median(v),
            "rounds": v,
            "cpu_s": statistics.median(cpus[name]),
        }
        for name, v in rates.items()
    }
    for backend, encoder in encoders.items():
        runs[f"pack {backend}"]["encoder"] = encoder
    return runs


def bench(args, work: Path) -> dict:
    corpus, tokenizer_path = work / "corpus.jsonl", work / "tokenizer.json"
    t0 = time.perf_counter()
    n_docs = write_corpus(corpus, int(args.corpus_mb * 1e6))
    t1 = time.perf_counter()
    train_tokenizer(corpus, tokenizer_path, args.vocab, int(args.train_mb * 1e6))
    t2 = time.perf_counter()
    mb = corpus.stat().st_size / 1e6
    print(
        f"corpus {mb:.1f} MB JSONL, {n_docs:,} documents (generated in {t1 - t0:.1f}s); "
        f"byte-level BPE vocab {args.vocab} trained on {args.train_mb:g} MB in {t2 - t1:.1f}s; "
        f"{args.procs} processes, {args.batch_docs} documents per batch, {args.rounds} rounds; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if missing := uncompiled(("numpy", "fsspec", "llmtrain.data_pack.pack_worker")):
        print(
            f"note: {', '.join(missing)} have no compiled bytecode here (PYTHONDONTWRITEBYTECODE "
            "with an install that did not compile it): each of pack's workers compiles them at "
            "its start, which an installed environment does not; `python -m compileall` the "
            "environment for a user's figures"
        )
    source = corpus
    if args.format == "parquet":
        source = work / "corpus.parquet"
        write_parquet(corpus, source)
        print(f"pack reads the same documents as Parquet: {source.stat().st_size / 1e6:.1f} MB")
    res: dict = {"corpus_mb": mb, "documents": n_docs, "procs": args.procs, "format": args.format}
    runs = res["runs"] = measure_ours(args, corpus, tokenizer_path, work, source)
    res["fast_check_s"] = fast_check_seconds(corpus, tokenizer_path)
    ours = packed_tokens(work / "pack-fast")
    res["fast_vs_hf_ids"] = compare_ids(ours, packed_tokens(work / "pack-hf"))
    if args.modalities_python:
        got = run_modalities(args.modalities_python, corpus, tokenizer_path, work, args.procs)
        if isinstance(got, str):
            res["modalities_error"] = got
        else:
            index_s, pack_s, wall, pbin = got
            theirs = read_pbin(pbin)
            for name, seconds in (
                ("modalities pack_encoded_data", pack_s),
                ("modalities index+pack", index_s + pack_s),
                ("modalities index+pack wall", wall),
            ):
                runs[name] = {"tokens": len(theirs), "tokens_per_s": rate(len(theirs), seconds)}
            res["modalities_ids"] = compare_ids(ours, theirs)
    for r in runs.values():
        r["seconds"] = r["tokens"] / r["tokens_per_s"]
    res["load_average_end"] = os.getloadavg()[0]
    report(res)
    if args.rss_gb:
        res["peak_rss"] = [
            peak_rss(work, tokenizer_path, gb, args.procs) for gb in (args.rss_gb / 10, args.rss_gb)
        ]
    return res


def uncompiled(modules: tuple[str, ...]) -> list[str]:
    """Those of `modules` whose source has no .pyc beside it."""
    import importlib.util

    missing = []
    for name in modules:
        origin = importlib.util.find_spec(name).origin
        if not os.path.exists(importlib.util.cache_from_source(origin)):
            missing.append(name)
    return missing


def peak_rss(work: Path, tokenizer_path: Path, gb: float, procs: int) -> dict:
    """Pack a Parquet corpus of `gb` GB with `llmtrain data pack` and sample the RSS of its
    processes every 0.1 s: the largest single process and the whole tree."""
    import psutil

    jsonl, parquet, out = work / "rss.jsonl", work / "rss.parquet", work / "rss.zarr"
    write_corpus(jsonl, int(gb * 1e9), seed=7)
    write_parquet(jsonl, parquet)
    jsonl.unlink()
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        "llmtrain",
        "data",
        "pack",
        str(parquet),
        "-o",
        str(out),
        "--tokenizer",
        f"hf:{tokenizer_path}",
        "--workers",
        str(procs),
        "--no-progress",
        "--log-dir",
        str(work / "rss-logs"),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    top, largest, tree = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        try:
            rss = [p.memory_info().rss for p in [top, *top.children(recursive=True)]]
        except psutil.Error:
            rss = []
        largest, tree = max(largest, *rss, 0), max(tree, sum(rss))
        time.sleep(0.1)
    output = proc.communicate()[0]
    if proc.returncode:
        raise SystemExit(f"the RSS pack failed:\n{output}")
    row = {
        "input_gb": parquet.stat().st_size / 1e9,
        "seconds": time.perf_counter() - t0,
        "largest_process_mb": largest / 1e6,
        "all_processes_mb": tree / 1e6,
    }
    print(
        f"peak RSS packing {row['input_gb']:.2f} GB of Parquet ({gb:g} GB as JSONL) in "
        f"{row['seconds']:.0f}s: largest process {row['largest_process_mb']:.0f} MB, all "
        f"{procs + 1} processes {row['all_processes_mb']:.0f} MB"
    )
    parquet.unlink()
    shutil.rmtree(out, ignore_errors=True)
    return row


def report(res: dict) -> None:
    runs = res["runs"]
    tps = {k: r["tokens_per_s"] for k, r in runs.items()}
    row = "{:<30} {:>8} {:>7} {:>13} {:>12}  {}"
    print(
        row.format("measure (median of rounds)", "seconds", "CPU s", "tokens", "tokens/s", "note")
    )
    notes = {
        "ceiling hf": "HF encode_batch_hf, texts in memory",
        "ceiling fast": "tiktoken fast path, texts in memory",
        "modalities pack_encoded_data": "one run, timed inside its process",
        "modalities index+pack": "create_raw_index + pack_encoded_data",
        "modalities index+pack wall": "the same, incl. interpreter start and imports",
    }
    for backend in ("hf", "fast"):
        # each round runs the ceiling and pack back to back: the ratio within a round is spared
        # the drifts of a shared machine's speed that a ratio of medians would carry
        rounds = [
            p / c
            for p, c in zip(
                runs[f"pack {backend}"]["rounds"], runs[f"ceiling {backend}"]["rounds"], strict=True
            )
        ]
        ratio = statistics.median(rounds)
        res[f"pack_over_ceiling_{backend}"] = ratio
        res[f"pack_over_ceiling_{backend}_rounds"] = rounds
        encoder = runs[f"pack {backend}"]["encoder"]
        notes[f"pack {backend}"] = (
            f"{ratio:.3f} of ceiling {backend} (goal >= {GOAL_CEILING} "
            f"{verdict(ratio >= GOAL_CEILING)}; rounds {min(rounds):.3f}-{max(rounds):.3f}); "
            f"encoder={encoder}"
        )
    for name, r in runs.items():
        print(
            row.format(
                name,
                f"{r['seconds']:.2f}",
                f"{r['cpu_s']:.2f}" if "cpu_s" in r else "-",
                f"{r['tokens']:,}",
                f"{r['tokens_per_s']:,.0f}",
                notes.get(name, ""),
            )
        )
    res["fast_speedup_ceiling"] = tps["ceiling fast"] / tps["ceiling hf"]
    res["fast_speedup_pack"] = tps["pack fast"] / tps["pack hf"]
    print(
        f"fast vs hf: ceiling {res['fast_speedup_ceiling']:.2f}x, pack "
        f"{res['fast_speedup_pack']:.2f}x; token ids fast pack vs hf pack: {res['fast_vs_hf_ids']}"
    )
    for backend in ("hf", "fast"):
        efficiency = runs[f"ceiling {backend}"]["cpu_s"] / runs[f"pack {backend}"]["cpu_s"]
        res[f"cpu_efficiency_{backend}"] = efficiency
        print(
            f"CPU, {backend}: the ceiling's encoding takes {efficiency:.3f} of the CPU time pack "
            "uses in all its processes (less sensitive than tokens/s to other load on the machine)"
        )
    print(
        f"the default pack checks the fast path against HF on a sample (in a thread, while the "
        f"workers start): {res['fast_check_s']:.2f}s of CPU in its "
        f"{runs['pack fast']['seconds']:.2f}s"
    )
    if "modalities_error" in res:
        print(f"modalities: NOT MEASURED: {res['modalities_error']}")
    elif "modalities pack_encoded_data" in tps:
        for ref in ("modalities pack_encoded_data", "modalities index+pack"):
            speedup = tps["pack fast"] / tps[ref]
            res[f"speedup_vs_{ref.replace(' ', '_')}"] = speedup
            print(
                f"pack (default encoder) vs {ref}: {speedup:.2f}x tokens/s "
                f"(goal >= {GOAL_MODALITIES} {verdict(speedup >= GOAL_MODALITIES)})"
            )
        print(f"token ids ours vs modalities: {res['modalities_ids']}")
    else:
        print("modalities: not run (pass --modalities-python PATH)")
    print(
        f"load average at the end {res['load_average_end']:.1f} (judge ratios on a quiet machine)"
    )


if __name__ == "__main__":
    sys.exit(main())
