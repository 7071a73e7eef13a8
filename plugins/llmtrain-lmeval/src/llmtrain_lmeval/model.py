"""The `llmtrain` model of lm-evaluation-harness: a committed llmtrain checkpoint scored by
llmtrain's downstream scorer, so the harness's numbers and `llmtrain eval-tasks`' agree.

    lm_eval --model llmtrain --model_args checkpoint=runs/x/checkpoints --tasks hellaswag

- `loglikelihood`: the (context, continuation) pairs of one document that share a context become
  one `TaskItem` with the continuations as its choices and no delimiter, as llmtrain's own tasks
  hold a question's options; `llmtrain.downstream.requests.option_requests` turns them into token
  rows (the harness's tokenization: the continuation's tokens are those of the whole string minus
  the context's, trailing spaces move to the continuation, an empty context is the
  end-of-document token) and `llmtrain.downstream.scoring.score` scores them: a packing model
  reads the shared context once for all of its options, and the rows and batches are those of
  `llmtrain eval-tasks` at the same batch size, so both give the same bits.
- `loglikelihood_rolling`: `rolling_requests`' disjoint windows, summed per document.
- `generate_until`: `llmtrain.models.generate.generate`, greedy unless the task samples, cut at
  the first stop string.

The checkpoint may hold any model that keeps `llmtrain.core_mesh.interfaces.LanguageModel`'s
contract (the Transformer, the MoE model, a plugin's own). One process; `device` (default: cuda when there is one) and `dtype` choose where it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, Self

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import TaskItem
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.downstream.requests import Request, option_requests, rolling_requests
from llmtrain.downstream.scoring import Batching, Score, module_runner, score
from llmtrain.models.generate import generate
from llmtrain.train_loop.saved_model import load_model, tokenizer_of

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# arguments lm-eval passes to every model from its own command-line options (`--batch_size`,
# `--device`, ...); the same names in --model_args win over them
HARNESS_OPTIONS = ("batch_size", "max_batch_size", "device")
FIRST_CHUNK = 16  # generated tokens before the stop strings are first looked for


class HarnessRequest(Protocol):
    """What this model reads of lm-eval's `Instance`: its arguments (context, continuation) for
    loglikelihood, (text,) for loglikelihood_rolling, (context, generation kwargs) for
    generate_until; and the task and document it belongs to (None where the caller made the
    instance without them)."""

    @property
    def args(self) -> tuple[Any, ...]: ...

    @property
    def task_name(self) -> str | None: ...

    @property
    def doc_id(self) -> int | None: ...


# lm-eval ships no type information (py.typed or stubs), so its LM is Any here
class LLMTrainLM(LM):  # type: ignore[misc]
    """An llmtrain checkpoint as an lm-eval model.

    `checkpoint`: a checkpoint directory (`runs/<name>/checkpoints`); `step`: default the newest
    committed one. `batch_size`: rows per forward (`auto` means 32). `max_length`: tokens of
    context + continuation per row (default: the model's max_seq_len). `tokenizer`: default the
    one the checkpoint was trained with (`llmtrain generate --tokenizer`'s spellings).
    `max_gen_toks`: generation's default length when a task gives none.
    """

    def __init__(
        self,
        checkpoint: str,
        step: int | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        tokenizer: str | None = None,
        max_gen_toks: int = 256,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise UserError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        plugins = PluginManager().load_entry_points()
        model, info, self.step = load_model(str(checkpoint), step, plugins)
        self.checkpoint = str(checkpoint)
        self.tokenizer = tokenizer_of(info, tokenizer, plugins)
        options = model.options  # what lm-eval needs of a model: `LanguageModel`
        self.max_length = int(max_length or options.max_seq_len)
        if self.max_length > options.max_seq_len:
            raise UserError(
                f"max_length={self.max_length} is longer than the model's max_seq_len "
                f"{options.max_seq_len}"
            )
        self._device = pick_device(device)
        self.model = model.to(self._device, DTYPES[dtype]).eval()
        self.batch_size = batch_rows(batch_size, max_batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._runner = module_runner(self.model)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> Self:
        """lm-eval's options (`--batch_size`, `--device`) fill what --model_args leaves out; the
        harness passes `--batch_size`'s default (1) too, so --model_args must win."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> Self:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    # -- scoring ---------------------------------------------------------------------------

    def _scores(self, rows: Sequence[Request]) -> list[Score]:
        # packed rows as long as the model takes, as `llmtrain eval-tasks` packs them
        batching = Batching(rows=self.batch_size)
        return score(rows, self._runner, batching, self._device, max_len=self.max_length)

    def loglikelihood(
        self, requests: Sequence[HarnessRequest], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        items, places = items_by_document(requests)
        rows = option_requests(items, self.tokenizer, self.max_length)
        found = {(row.item, row.option): s for row, s in zip(rows, self._scores(rows), strict=True)}
        results = [(found[place].loglikelihood, found[place].greedy) for place in places]
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", tuple(request.args), result)
        return results

    def loglikelihood_rolling(
        self, requests: Sequence[HarnessRequest], disable_tqdm: bool = False
    ) -> list[float]:
        texts = [request.args[0] for request in requests]
        items = [TaskItem(("",), (text,), delimiter="") for text in texts]
        rows = rolling_requests(items, self.tokenizer, self.max_length)
        totals = [0.0] * len(items)
        for row, result in zip(rows, self._scores(rows), strict=True):
            totals[row.item] += result.loglikelihood
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # -- generation ------------------------------------------------------------------------

    def generate_until(
        self, requests: Sequence[HarnessRequest], disable_tqdm: bool = False
    ) -> list[str]:
        out: list[str] = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = request.args
            text = self._generate(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate(self, context: str, kwargs: dict[str, Any]) -> str:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        budget = next(
            (int(kwargs[k]) for k in ("max_gen_toks", "max_new_tokens") if k in kwargs),
            self.max_gen_toks,
        )
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample", temperature > 0):
            temperature = 0.0
        eod = self.tokenizer.eod_id
        ids = list(self.tokenizer.encode_batch([context])[0]) if context else [eod]
        keep = self.max_length - budget if budget < self.max_length else self.max_length - 1
        ids = ids[-keep:]
        budget = min(budget, self.max_length - len(ids))
        generator = torch.Generator(device=self._device).manual_seed(int(kwargs.get("seed", 0)))
        new: list[int] = []
        chunk = FIRST_CHUNK
        # in growing chunks, so a stop string found early ends the work early
        while len(new) < budget:
            n = min(chunk, budget - len(new))
            prompt = torch.tensor([ids + new], device=self._device)
            got = generate(
                self.model,
                prompt,
                n,
                eod_id=eod,
                vocab_size=self.tokenizer.vocab_size,
                generator=generator,
                temperature=temperature,
                top_k=kwargs.get("top_k"),
                top_p=kwargs.get("top_p"),
            )[0, prompt.size(1) :].tolist()
            new += got
            if len(got) < n or (got and got[-1] == eod):
                break
            if any(s in self._decode(new) for s in until):
                break
            chunk *= 2
        return cut_at(self._decode(new), until)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eod_id])


def items_by_document(
    requests: Sequence[HarnessRequest],
) -> tuple[list[TaskItem], list[tuple[int, int]]]:
    """One item per (task, document, context) in first-seen order, its choices the continuations
    asked after that context, and each request's (item, option). A document's options are one
    item, as in llmtrain's own tasks: a packing model scores them in one row with one copy of
    the context, and two documents that happen to ask the same question stay apart."""
    index: dict[tuple[str | None, int | None, str], int] = {}
    choices: list[list[str]] = []
    contexts: list[str] = []
    places = []
    for request in requests:
        context, continuation = request.args
        key = (request.task_name, request.doc_id, context)
        if key not in index:
            index[key] = len(contexts)
            contexts.append(context)
            choices.append([])
        item = index[key]
        places.append((item, len(choices[item])))
        choices[item].append(continuation)
    items = [
        TaskItem((context,), tuple(options), delimiter="")
        for context, options in zip(contexts, choices, strict=True)
    ]
    return items, places


def pick_device(device: str | None) -> torch.device:
    """The device asked for, or cuda when there is one; lm-eval asks for `cuda` by default, which
    falls back to the CPU on a machine without one (as lm-eval's own models do)."""
    cuda = torch.cuda.is_available()
    if device is None or (str(device).startswith("cuda") and not cuda):
        if device is not None:
            log.warning("device %s is not available; using the CPU", device)
        return torch.device("cuda" if cuda else "cpu")
    return torch.device(device)


def batch_rows(batch_size: int | str | None, max_batch_size: int | None) -> int:
    """Rows per forward from lm-eval's `batch_size` (an int, or `auto`/`auto:N`: 32)."""
    if batch_size is None or (isinstance(batch_size, str) and batch_size.startswith("auto")):
        rows = 32
    else:
        try:
            rows = int(batch_size)
        except ValueError:
            raise UserError(f"batch_size={batch_size!r}: expected a number or 'auto'") from None
    if max_batch_size:
        rows = min(rows, int(max_batch_size))
    if rows < 1:
        raise UserError(f"batch_size={batch_size!r}: must be at least 1")
    return rows


def cut_at(text: str, stops: list[str]) -> str:
    """The text before the first stop string in it."""
    for stop in stops:
        if stop:
            text = text.split(stop, 1)[0]
    return text
