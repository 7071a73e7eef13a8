"""`llmtrain which RUN_DIR --step N`: the documents a step of a run trained on.

Which windows a step reads is a pure function of the run's config (datasets and weights,
seq_len, seed, shuffle, global batch) and of how many data-parallel ranks share the batch, so
nothing is logged during training for this: the sampler is rebuilt as the Trainer builds it and
each sample of the step's global batch (or of one rank's share) is traced to its dataset, window
and documents, through the provenance `llmtrain data pack` stores (`data_pack.provenance`).

Step N is the step metrics.jsonl and the logs call N, the optimizer step that ends at N: it reads
the data of step index N - 1 (`BatchPlan.step`). The data-parallel size at step N comes from the
run's rank-0 log (each start records its layout, a resume the step it went on from), else from
`summary.json`'s world size and the config's mesh; `--data-ranks` overrides both. Only the
config's seed, data, mesh and training sections (less the objective) are read, so the run's model,
logger, callback and objective plugins need not be installed where this runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmtrain.ablate.runs import read_summary
from llmtrain.core_mesh.cli import Context
from llmtrain.core_mesh.cli_conventions import json_option, main_object
from llmtrain.core_mesh.config import ConfigValueError, parse_yaml, structure
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.mesh import MeshSpec
from llmtrain.core_mesh.redact import refuse_redacted
from llmtrain.train_loop.run_config import DataConfig, TrainingConfig

if TYPE_CHECKING:
    import numpy as np

    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.data_pack.loader import WindowDataset
    from llmtrain.data_pack.provenance import DocumentSpan, SampleDocuments
    from llmtrain.train_loop.mixture_schedule import Schedule

SECTIONS = ("seed", "data", "mesh", "training")
START_LOG = "logs/rank0.jsonl"


@attrs.frozen(kw_only=True)
class DataOrder:
    """The sections of a run config that decide which windows each step reads."""

    seed: int = 0
    data: DataConfig
    mesh: MeshSpec = attrs.Factory(MeshSpec)
    training: TrainingConfig

    @property
    def data_seed(self) -> int:
        return self.seed if self.data.seed is None else self.data.seed


@attrs.frozen
class DataRanks:
    """How many data-parallel ranks shared a step's global batch, and how that is known."""

    count: int
    found_in: str


def read_order(run_dir: Path) -> DataOrder:
    """The data order of the run in `run_dir` (its resolved config.yaml)."""
    path = run_dir / "config.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{run_dir}: not a run directory (it has no config.yaml)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    raw = parse_yaml(text, str(path))
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a run config (expected a mapping)")
    for key in [k for k in raw if k not in SECTIONS]:
        del raw[key]  # in place: the parsed mapping keeps its line numbers for errors
    training = raw.get("training")
    if isinstance(training, dict):
        # the loss decides no window, and its plugin need not be installed here
        training.pop("objective", None)
    refuse_redacted(raw, str(path))  # data.storage_options open the datasets
    return structure(raw, DataOrder, source=str(path))


def _starts(log: Path) -> list[tuple[int, int | None, str | None]]:
    """(step it went on from, world size, mesh) of each start of the run that trained (resumed
    or logged a step), oldest first, from the rank-0 log; [] without one."""
    starts: list[list[Any]] = []
    try:
        lines = log.open(encoding="utf-8")
    except FileNotFoundError:
        return []
    with lines:
        for line in lines:
            if '"run.' not in line and '"step"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed process
            name = event.get("event")
            if name == "run.start":
                starts.append([0, event.get("world_size"), event.get("mesh"), False])
            elif starts and name == "run.resumed":
                starts[-1][0], starts[-1][3] = int(event["step"]), True
            elif starts and name == "step":
                starts[-1][3] = True
    return [(first, world, mesh) for first, world, mesh, trained in starts if trained]


def _data_parallel(order: DataOrder, world: int, mesh: str | None) -> int:
    """dp_replicate x dp_shard of the logged layout, else of the config's mesh at `world`."""
    names = ("dp_replicate", "dp_shard")
    degrees = [m for name in names if (m := re.search(rf"\b{name}=(\d+)", mesh or ""))]
    if len(degrees) == len(names):
        return math.prod(int(d.group(1)) for d in degrees)
    return order.mesh.resolve(world).dp


def data_ranks(run_dir: Path, order: DataOrder, step: int, given: int | None) -> DataRanks:
    """The data-parallel size that read step `step` (see the module docstring)."""
    if given is not None:
        if given < 1:
            raise UserError(f"--data-ranks {given}: must be at least 1")
        return DataRanks(given, "--data-ranks")
    for first, world, mesh in reversed(_starts(run_dir / START_LOG)):
        if first < step and world:
            dp = _data_parallel(order, int(world), mesh)
            went_on = f"resumed at step {first}" if first else "started at step 0"
            return DataRanks(dp, f"{START_LOG}: {went_on} with world size {world}")
    summary = read_summary(run_dir) or {}
    if summary.get("world_size"):
        world = int(summary["world_size"])
        return DataRanks(
            _data_parallel(order, world, None),
            f"summary.json: world size {world}, the config's mesh",
        )
    raise UserError(
        f"{run_dir}: neither {START_LOG} nor summary.json says how many processes the run had; "
        "pass --data-ranks D (its data-parallel size)"
    )


def _logged_schedule(log: Path) -> Schedule | None:
    """The mixture schedule the run's last start went on with (`data.mixture` in the rank-0
    log); None without one (a run from before the log recorded it)."""
    schedule = None
    try:
        lines = log.open(encoding="utf-8")
    except FileNotFoundError:
        return None
    with lines:
        for line in lines:
            if '"data.mixture"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed process
            if event.get("event") == "data.mixture" and isinstance(event.get("schedule"), list):
                schedule = event["schedule"]
    return schedule


def _open(order: DataOrder, run_dir: Path, batch: StepBatch) -> WindowDataset:
    """The training windows, opened with the arguments the Trainer gives `open_windows`, mixed
    by the schedule the run logged (a resume may have kept one its config no longer says), else
    the config's."""
    from llmtrain.data_pack.loader import open_windows
    from llmtrain.train_loop.mixture_schedule import sampler_phases, schedule_of

    data = order.data
    schedule = _logged_schedule(run_dir / START_LOG) or schedule_of(data, batch.total_steps)
    phases = sampler_phases(schedule, batch.global_batch)
    return open_windows(
        [d.path for d in data.train],
        data.seq_len,
        weights=schedule[0]["weights"] if phases is None else None,
        phases=phases,
        seed=order.data_seed,
        shuffle=data.shuffle,
        cache_bytes=data.cache_mib << 20,
        storage_options=data.storage_options,
    )


def _check_provenance(order: DataOrder, data: WindowDataset, sources: set[int]) -> None:
    for index in sorted(sources):
        if not data.sources[index].dataset.has_origins:
            path = order.data.train[index].path
            raise UserError(
                f"data.train[{index}].path: {path} records no provenance (packed before llmtrain "
                "recorded where documents come from, a chat dataset, or a merge of such "
                "datasets); pack it again with `llmtrain data pack` to trace its samples"
            )


class FirstWords:
    """The first words of documents, decoded with the tokenizer they were packed with."""

    def __init__(self, data: WindowDataset, words: int, plugins: PluginManager | None):
        from llmtrain.data_pack.tokenizer import tokenizer_from_raw

        self.data, self.words = data, words
        spec = data.sources[0].dataset.meta["tokenizer"]["spec"]
        self.tokenizer = tokenizer_from_raw(spec, plugins) if words else None
        self._seen: dict[tuple[int, int], str] = {}

    def __call__(self, source: int, span: DocumentSpan) -> str:
        if self.tokenizer is None:
            return ""
        key = (source, span.document)
        if key not in self._seen:
            end = span.doc_stop - 1  # without the eod
            stop = min(end, span.doc_start + 8 * self.words + 16)
            dataset = self.data.sources[source].dataset
            words = self.tokenizer.decode(dataset.read(span.doc_start, stop)).split()
            if stop < end and len(words) <= self.words:
                words = words[:-1]  # the last one may be cut short
            self._seen[key] = " ".join(words[: self.words])
        return self._seen[key]


@attrs.frozen
class StepBatch:
    """Step `step`'s global batch: its size, the data ranks that split it, and the samples
    listed (one rank's share, or all)."""

    step: int
    global_batch: int
    total_steps: int
    ranks: DataRanks
    samples: np.ndarray  # global sample indices

    @property
    def first(self) -> int:
        return (self.step - 1) * self.global_batch

    def rank_of(self, sample: int) -> int:
        return (sample - self.first) // (self.global_batch // self.ranks.count)


def step_batch(
    run_dir: Path, order: DataOrder, step: int, rank: int | None, given: int | None
) -> StepBatch:
    """The samples logged step `step` read (rank `rank`'s share, or the whole global batch):
    data step `step - 1` of `BatchPlan`, the plan the Trainer builds."""
    import numpy as np

    from llmtrain.data_pack.sampling import BatchPlan

    if step < 1:
        raise UserError(f"--step {step}: steps count from 1, as metrics.jsonl and the logs do")
    ranks = data_ranks(run_dir, order, step, given)
    try:
        global_batch, _ = order.data.batch_sizes(ranks.count)
    except ConfigValueError as exc:
        raise UserError(
            f"{run_dir / 'config.yaml'}: data.{exc.field}: {exc} ({ranks.found_in})"
        ) from None
    training = order.training
    total = training.total_steps(global_batch * order.data.seq_len)
    if step > total:
        raise UserError(f"--step {step} is beyond the run's {total} steps")
    if rank is not None and not 0 <= rank < ranks.count:
        raise UserError(
            f"--rank {rank} is outside 0..{ranks.count - 1}: step {step}'s global batch was split "
            f"over {ranks.count} data rank{'s' if ranks.count > 1 else ''} ({ranks.found_in})"
        )
    if rank is None:
        samples = np.arange((step - 1) * global_batch, step * global_batch)
    else:
        samples = np.concatenate(BatchPlan(global_batch, ranks.count, rank).step(step - 1))
    return StepBatch(step, global_batch, total, ranks, samples)


def _listed(
    found: SampleDocuments, batch: StepBatch, order: DataOrder, first_words: FirstWords
) -> dict[str, object]:
    """One sample and its documents, as plain data."""
    documents = [
        {
            "document": d.document,
            "source": d.url,
            "unit": d.unit,
            "number": d.number,
            "where": d.where,
            "id": d.id,
            "tokens": [d.start, d.stop],
            "window": [d.offset, d.offset + d.stop - d.start],
            "document_tokens": [d.doc_start, d.doc_stop],
            "cut_start": d.cut_start,
            "cut_end": d.cut_end,
            "words": first_words(found.source, d),
        }
        for d in found.documents
    ]
    return {
        "sample": found.sample,
        "rank": batch.rank_of(found.sample),
        "dataset": found.source,
        "path": order.data.train[found.source].path,
        "window": found.window,
        "tokens": [found.start, found.stop],
        "documents": documents,
    }


def trace(
    run_dir: Path,
    step: int,
    *,
    rank: int | None = None,
    data_ranks_given: int | None = None,
    words: int = 8,
    plugins: PluginManager | None = None,
) -> dict[str, Any]:
    """What `llmtrain which --json` prints: step `step`'s samples (rank `rank`'s share, or the
    whole global batch) with their documents."""
    from llmtrain.data_pack.provenance import sample_documents

    order = read_order(run_dir)
    batch = step_batch(run_dir, order, step, rank, data_ranks_given)
    data = _open(order, run_dir, batch)
    _check_provenance(order, data, set(data.sampler.lookup(batch.samples)[0].tolist()))
    first_words = FirstWords(data, words, plugins)
    return {
        "run": str(run_dir),
        "step": step,
        "data_step": step - 1,
        "total_steps": batch.total_steps,
        "global_batch": batch.global_batch,
        "seq_len": order.data.seq_len,
        "data_ranks": batch.ranks.count,
        "data_ranks_from": batch.ranks.found_in,
        "rank": rank,
        "datasets": [d.path for d in order.data.train],
        "samples": [
            _listed(found, batch, order, first_words)
            for found in sample_documents(data, batch.samples)
        ],
    }


def _cut(document: Mapping[str, object]) -> str:
    ends = [name for name in ("start", "end") if document[f"cut_{name}"]]
    return ",".join(ends) or "-"


def render(report: dict[str, Any]) -> str:
    """The report as aligned text: a line per sample, a row per document under it."""
    share = "" if report["rank"] is None else f", rank {report['rank']}'s share"
    ranks = report["data_ranks"]
    lines = [
        f"{report['run']} step {report['step']} (data step {report['data_step']}){share}: "
        f"{len(report['samples'])} samples of {report['seq_len']}+1 tokens, "
        f"{ranks} data rank{'s' if ranks > 1 else ''} ({report['data_ranks_from']})"
    ]
    header = ("window", "document", "from", "id", "cut", "first words")
    for sample in report["samples"]:
        lines.append(
            f"sample {sample['sample']} (rank {sample['rank']}): {sample['path']} window "
            f"{sample['window']}, tokens {sample['tokens'][0]}-{sample['tokens'][1]}"
        )
        rows = [header] + [
            (
                f"{d['window'][0]}-{d['window'][1]}",
                str(d["document"]),
                d["where"],
                d["id"] or "-",
                _cut(d),
                d["words"],
            )
            for d in sample["documents"]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += [
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    main_object(parser, "run_dir", metavar="RUN", help="a run directory (runs/<name>)")
    parser.add_argument(
        "--step", type=int, required=True, help="the step as metrics.jsonl and the logs number it"
    )
    parser.add_argument(
        "--rank", type=int, default=None, help="only this data rank's share (default: every rank's)"
    )
    parser.add_argument(
        "--data-ranks",
        type=int,
        default=None,
        metavar="D",
        help="the data-parallel size that read the step (default: from the run's logs)",
    )
    parser.add_argument("--words", type=int, default=8, metavar="K", help="first words shown")
    json_option(parser)


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.words < 0:
        raise UserError(f"--words {args.words}: must be 0 or more")
    report = trace(
        Path(args.run_dir),
        args.step,
        rank=args.rank,
        data_ranks_given=args.data_ranks,
        words=args.words,
        plugins=ctx.plugins,
    )
    if args.json:
        print(json.dumps(report, ensure_ascii=False, indent=1))
    else:
        print(render(report), end="")
    return 0
