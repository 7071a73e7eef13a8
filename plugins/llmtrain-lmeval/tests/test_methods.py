"""The adapter's three request kinds against lm-eval's transformers backend on the exported
model, called directly (as the harness's evaluator calls them): log-likelihoods with empty and
space-ended contexts and cut contexts, rolling log-likelihoods over several windows, greedy
generation cut at stop strings; and the adapter's argument handling."""

from __future__ import annotations

import pytest

MAX_LEN = 32  # short, so documents span several windows and long contexts are cut
# two implementations of one float32 model (ours packs a context's options into one row, the
# transformers backend runs a row per option): equal up to rounding, relative to the magnitude
REL, FLOOR = 1e-5, 1e-6


@pytest.fixture(scope="module")
def models(trained):
    from llmtrain_lmeval.model import LLMTrainLM
    from lm_eval.models.huggingface import HFLM

    ours = LLMTrainLM(trained.checkpoint, batch_size=3, max_length=MAX_LEN, device="cpu")
    theirs = HFLM(
        pretrained=trained.export, dtype="float32", device="cpu", batch_size=3, max_length=MAX_LEN
    )
    return ours, theirs


def instances(kind: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def test_loglikelihood_as_the_hf_backend(models):
    ours, theirs = models
    pairs = [
        ("The river follows", " a long road"),
        ("The river follows ", "a long road"),  # the space moves to the continuation
        ("", "Our team builds the bridge today!"),  # empty context: end-of-document first
        ("Question: Which café?\nAnswer:", " the garden."),
        (" ".join(["The robot paints the lamp."] * 12), " The storm"),  # cut to MAX_LEN
    ]
    mine = ours.loglikelihood(instances("loglikelihood", pairs))
    other = theirs.loglikelihood(instances("loglikelihood", pairs))
    for (ll, greedy), (ll_hf, greedy_hf) in zip(mine, other, strict=True):
        assert ll == pytest.approx(ll_hf, rel=REL, abs=FLOOR)
        assert greedy == greedy_hf


def test_a_documents_options_are_one_item_and_documents_stay_apart():
    """The harness's requests become llmtrain's items: one per document and context, the
    continuations its options in the order asked; two documents asking the same question are
    two items, as in the task file."""
    from llmtrain_lmeval.model import items_by_document
    from lm_eval.api.instance import Instance

    asked = [  # (document, context, continuation)
        (0, "Q: which?", " river"),
        (0, "Q: which?", " lamp"),
        (1, "Q: which?", " river"),
        (1, "Q: other?", " storm"),
        (0, "Q: which?", " café"),
    ]
    requests = [
        Instance("loglikelihood", {}, (context, continuation), i, metadata=("arc", doc, 1))
        for i, (doc, context, continuation) in enumerate(asked)
    ]
    items, places = items_by_document(requests)
    assert [(item.contexts, item.choices, item.delimiter) for item in items] == [
        (("Q: which?",), (" river", " lamp", " café"), ""),
        (("Q: which?",), (" river",), ""),
        (("Q: other?",), (" storm",), ""),
    ]
    assert places == [(0, 0), (0, 1), (1, 0), (2, 0), (0, 2)]


def test_loglikelihood_rolling_as_the_hf_backend(models):
    ours, theirs = models
    documents = [
        ("The river follows a long road near the café. " * 6).strip(),  # several windows
        "Short.",
    ]
    mine = ours.loglikelihood_rolling(instances("loglikelihood_rolling", [(d,) for d in documents]))
    other = theirs.loglikelihood_rolling(
        instances("loglikelihood_rolling", [(d,) for d in documents])
    )
    assert mine == pytest.approx(other, rel=REL, abs=FLOOR)
    assert len(ours.tokenizer.encode_batch(documents[:1])[0]) > 2 * MAX_LEN


def test_greedy_generation_as_the_hf_backend(models):
    ours, theirs = models
    requests = [
        ("The river", {"until": ["."], "max_gen_toks": 12, "do_sample": False}),
        ("Our team builds", {"until": ["\n\n", "!"], "max_gen_toks": 20}),
        ("The lamp", {"until": [], "max_gen_toks": 5}),
    ]
    mine = ours.generate_until(instances("generate_until", requests))
    other = theirs.generate_until(instances("generate_until", requests))
    assert mine == other
    assert all("." not in text for text in mine[:1])


def test_model_args_win_over_the_harness_defaults(trained):
    from llmtrain_lmeval.model import LLMTrainLM, batch_rows, cut_at

    lm = LLMTrainLM.create_from_arg_string(
        f"checkpoint={trained.checkpoint},batch_size=5,max_length=40",
        {"batch_size": 1, "max_batch_size": None, "device": "cuda"},  # what the CLI passes
    )
    assert (lm.batch_size, lm.max_length, lm.device.type) == (5, 40, "cpu")
    assert lm.step == 6
    assert batch_rows("auto", None) == 32 and batch_rows("auto:4", 8) == 8
    assert cut_at("one. two! three", [".", "!"]) == "one"


def test_bad_arguments_are_explained(trained):
    from llmtrain_lmeval.model import LLMTrainLM

    from llmtrain.core_mesh.errors import UserError

    with pytest.raises(UserError, match="longer than the model's max_seq_len 128"):
        LLMTrainLM(trained.checkpoint, max_length=1000, device="cpu")
    with pytest.raises(UserError, match="dtype='int8'"):
        LLMTrainLM(trained.checkpoint, dtype="int8")
    with pytest.raises(UserError, match="batch_size='big'"):
        LLMTrainLM(trained.checkpoint, batch_size="big", device="cpu")
