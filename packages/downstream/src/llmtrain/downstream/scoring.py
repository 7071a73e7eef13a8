"""Running score requests through a model: on one process (a plain module) or under any
parallel layout (a `ParallelModel`: FSDP, TP, PP, CP and their mixes).

Rows are sorted by length (longest first, so a batch's padding is small) and batched; each
row yields the summed log-probability of its scored tokens and how many of them were not the
model's greedy choice. Under data parallelism each data rank scores the options of its share of
the items, every rank runs the same number of batches (the collectives of FSDP need it), and
the results are gathered over the data ranks and checked: every request scored exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.core_mesh.interfaces import LanguageModel, ParallelModel
from llmtrain.downstream.packing import PackedBatch, PackedRow, packed_batch, packed_rows
from llmtrain.downstream.requests import Request

IGNORE = -100  # targets that are not scored


@attrs.frozen
class Score:
    """A request's result: the summed log-probability of its scored tokens, whether every one
    of them was the model's greedy choice, and how many there were."""

    loglikelihood: float
    greedy: bool
    tokens: int


def prediction_scores(
    logits: torch.Tensor, targets: torch.Tensor, owner: torch.Tensor, n: int
) -> torch.Tensor:
    """(n, 2): for each of n owners, the summed log-probability of its targets and the count
    of those that were not the arg-max, from one row of logits (N, vocab) per target."""
    logits = logits.float()
    logp = -F.cross_entropy(logits, targets, reduction="none")
    missed = (logits.argmax(-1) != targets).float()
    out = torch.zeros(n, 2, device=logits.device)
    out[:, 0].index_add_(0, owner, logp)
    out[:, 1].index_add_(0, owner, missed)
    return out


def row_scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, 2): `prediction_scores` of each row's scored targets. Only the scored positions are
    normalised (a full log-softmax over (B, T, vocab) would not fit for long rows)."""
    if hasattr(logits, "full_tensor"):  # a vocabulary-sharded DTensor (TP's loss parallelism)
        logits = logits.full_tensor()
    counted = targets != IGNORE
    rows = counted.nonzero()[:, 0]
    return prediction_scores(logits[counted], targets[counted], rows, targets.size(0))


Runner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


Logits = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@attrs.frozen
class PackedRunner:
    """Scores packed rows (`llmtrain.downstream.packing`: an item's options after one copy of
    their context). `logits(tokens, inputs)` runs the model with the keyword inputs
    `positions`, `attention_mask` and `logits_at` (a model whose `packed_rows` is True takes
    them) and returns the logits of only the positions where a target is predicted."""

    logits: Logits

    @torch.no_grad()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        inputs = {
            "positions": batch.positions,
            "attention_mask": batch.attention_mask,
            "logits_at": batch.at,
        }
        logits = self.logits(batch.tokens, inputs)
        return prediction_scores(
            logits[batch.gather], batch.targets, batch.owner, len(batch.requests)
        )


def takes_packed_rows(model: object) -> bool:
    """Whether the model declares that its forward takes packed rows (`LanguageModel.packed_rows`:
    `positions`, `attention_mask` and `logits_at`); a module that declares nothing does not."""
    return isinstance(model, LanguageModel) and model.packed_rows


def module_runner(model: torch.nn.Module) -> Runner | PackedRunner:
    """Scores requests with a whole model on one process: packed rows when the model takes
    them (each shared context computed once), else one row per request."""
    if takes_packed_rows(model):
        return PackedRunner(lambda tokens, inputs: model(tokens, **inputs))

    @torch.no_grad()
    def run(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return row_scores(model(tokens), targets)

    return run


def layout_runner(model: ParallelModel) -> Runner | PackedRunner:
    """Scores requests with a model laid out over the mesh: packed rows through its `evaluate`
    where the layout splits neither the model nor the sequence (data parallelism, FSDP), else
    one row per request through `parallel_runner`."""
    unsplit = len(model.parts) == 1 and all(model.size(d) == 1 for d in ("pp", "cp", "tp"))
    if not (unsplit and takes_packed_rows(model.parts[0])):
        return parallel_runner(model)

    def logits(tokens: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        kept: list[torch.Tensor] = []

        def keep(logits: torch.Tensor, _targets: torch.Tensor) -> torch.Tensor:
            kept.append(logits)
            return logits.new_zeros(())

        # the targets are not read: the packed batch says what each logit predicts
        model.evaluate(tokens, tokens, keep, inputs=inputs)
        return kept[0]

    return PackedRunner(logits)


def parallel_runner(model: ParallelModel) -> Runner:
    """Scores rows with a model laid out over the mesh: its `evaluate` runs the layout's
    forward (pipeline schedule, sequence shards, ...) with a loss function that also keeps the
    per-row scores; the stages and sequence shards that saw part of a row are summed."""

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        kept: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            scores = row_scores(logits, target)
            kept.append(scores.detach())
            return -scores[:, 0].sum()

        model.evaluate(tokens, targets, loss_fn)
        if kept:  # the last pipeline stage: one entry per micro-batch, in order
            scores = torch.cat(kept)
        else:
            scores = torch.zeros(tokens.size(0), 2, device=tokens.device)
        if scores.size(0) != tokens.size(0):
            raise RuntimeError(f"scored {scores.size(0)} rows of a batch of {tokens.size(0)}")
        for dim in ("pp", "cp"):
            if model.size(dim) > 1:
                dist.all_reduce(scores, group=model.dim(dim).get_group())
        return scores

    return run


@attrs.frozen
class Batching:
    """How rows become batches. `rows`: rows per batch. `length`: pad every batch to this many
    tokens (pipelines and compiled models want one shape); None pads to the batch's longest row,
    rounded up to `multiple` (context parallelism needs 2 x cp)."""

    rows: int = 16
    length: int | None = None
    multiple: int = 1


def batch_tensors(
    rows: Sequence[Request], batching: Batching, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of `batching.rows` rows (empty rows are padding and score nothing)."""
    longest = max((len(r.tokens) - 1 for r in rows), default=1)
    length = batching.length or -(-max(longest, 1) // batching.multiple) * batching.multiple
    tokens = torch.zeros(batching.rows, length, dtype=torch.long)
    targets = torch.full((batching.rows, length), IGNORE, dtype=torch.long)
    for b, request in enumerate(rows):
        ids = torch.tensor(request.tokens, dtype=torch.long)
        n = ids.numel() - 1
        tokens[b, :n] = ids[:-1]
        if request.scored:
            targets[b, n - request.scored : n] = ids[n - request.scored + 1 :]
    return tokens.to(device), targets.to(device)


@attrs.frozen
class DataSplit:
    """Which share of the items this rank scores and how to gather: `rank` of `world` data
    ranks, `group` the process group over them (None on one process)."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None


def score(
    requests: Sequence[Request],
    runner: Runner | PackedRunner,
    batching: Batching,
    device: torch.device | str,
    split: DataSplit = DataSplit(),
    max_len: int | None = None,
) -> list[Score]:
    """Every request's score, in the order given (the same list on every rank). `max_len`:
    the most tokens of a packed row (default: the longest request's)."""
    mine = [i for i, r in enumerate(requests) if r.item % split.world == split.rank]
    # a packed runner takes batches of packed rows, a plain one batches of request indices
    row_batches: list[list[PackedRow]] = []
    index_batches: list[list[int]] = []
    if isinstance(runner, PackedRunner):
        limit = max_len or max((len(r.tokens) - 1 for r in requests), default=1)
        rows = packed_rows(requests, mine, limit)
        rows.sort(key=lambda row: -len(row.tokens))
        row_batches = _batches(rows, batching.rows)
    else:
        index_batches = _batches(
            sorted(mine, key=lambda i: -len(requests[i].tokens)), batching.rows
        )
    n_batches = _most(len(row_batches) + len(index_batches), split, device)  # one is empty
    results: list[_Result] = []
    for b in range(n_batches):
        if isinstance(runner, PackedRunner):
            chosen_rows = row_batches[b] if b < len(row_batches) else []
            padded = _padded(chosen_rows, batching)
            batch = packed_batch(chosen_rows, batching.rows, padded, device)
            scores = runner(batch).cpu().tolist()
            order = batch.requests
        else:
            chosen = index_batches[b] if b < len(index_batches) else []
            tokens, targets = batch_tensors([requests[i] for i in chosen], batching, device)
            scores = runner(tokens, targets).cpu().tolist()
            order = tuple(chosen)
        results += [(i, *scores[k], requests[i].scored) for k, i in enumerate(order)]
    return _gathered(results, len(requests), split)


# (request index, log-likelihood, tokens not the greedy choice, scored tokens)
_Result = tuple[int, float, float, int]
_T = TypeVar("_T")


def _batches(units: list[_T], size: int) -> list[list[_T]]:
    return [units[s : s + size] for s in range(0, len(units), size)]


def _padded(rows: Sequence[PackedRow], batching: Batching) -> int:
    longest = max((len(row.tokens) for row in rows), default=1)
    return batching.length or -(-longest // batching.multiple) * batching.multiple


def _most(count: int, split: DataSplit, device: torch.device | str) -> int:
    if split.world == 1:
        return count
    value = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=split.group)
    return int(value.item())


def _gathered(results: list[_Result], total: int, split: DataSplit) -> list[Score]:
    if split.world > 1:
        shares: list[list[_Result]] = [[]] * split.world  # each replaced
        dist.all_gather_object(shares, results, group=split.group)
        results = [r for share in shares for r in share]
    seen = sorted(r[0] for r in results)
    if seen != list(range(total)):
        lost = sorted(set(range(total)) - set(seen))
        twice = len(seen) - len(set(seen))
        raise RuntimeError(
            f"downstream scoring gathered {len(seen)} results for {total} requests "
            f"({len(lost)} missing, {twice} twice): a bug"
        )
    # every index exactly once (checked above): in index order, the results are the requests'
    return [
        Score(loglikelihood, missed == 0, scored)
        for _, loglikelihood, missed, scored in sorted(results, key=lambda r: r[0])
    ]
