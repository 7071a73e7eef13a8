"""The attention seam: masks as compositions of mask functions (`attention_masks`).

Every composition the model builds, and the ones a prefix LM or downstream scoring builds, is
held to a reference written here pair by pair in plain Python: the dense mask SDPA takes, the
BlockMask FlexAttention takes (its tiles against torch's create_block_mask, its mask_mod
against the reference), and a model's logits through eager and compiled FlexAttention against
its dense path. Then which blocks share a mask, what `describe()` names, and a mask function
brought by a subclass, as a plugin brings its own.

FlexAttention runs on CUDA only, so the model tests switch it on for CPU (`flex_on`) and compare
forward logits; gradients through the CUDA kernel are the GPU tests' to check.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from llmtrain.models import attention_masks
from llmtrain.models.attention_masks import (
    AttentionMask,
    Causal,
    Document,
    Given,
    MaskFunction,
    MaskRows,
    PrefixBidirectional,
    SlidingWindow,
    block_mask,
    document_ids,
    positions_in_document,
)
from llmtrain.models.config import AttentionOptions, TransformerConfig
from llmtrain.models.transformer import Transformer

# the eager FlexAttention these tests compare is the reference torch warns about, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 128
BLOCK_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


def starts_of(lengths: list[int]) -> torch.Tensor:
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return starts


def prefix_of(lengths: list[int], n: int) -> torch.Tensor:
    """The first n tokens of every document (all of a shorter one) are its prefix."""
    return torch.tensor([i < n for length in lengths for i in range(length)])


# name: the document lengths of each of two rows (21 and 24 tokens: tiles of 8 end inside a row
# or on its end; documents of one token, documents across tile edges)
LAYOUTS = {
    "docs": ([5, 1, 9, 6], [21]),
    "edges": ([8, 8, 3, 5], [7, 9, 8]),
}


@attrs.frozen
class Data:
    """A layout's per-row data as the mask functions read it (tensors) and the reference reads
    it (lists)."""

    rows: MaskRows

    @property
    def T(self) -> int:
        return self.rows.q_pos.numel()

    def lists(self, name: str) -> list | None:
        data = getattr(self.rows, name)
        return None if data is None else data.tolist()


def layout_data(name: str) -> Data:
    lengths = LAYOUTS[name]
    starts = torch.stack([starts_of(row) for row in lengths])
    T = starts.size(1)
    prefix = torch.stack([prefix_of(row, 3) for row in lengths])
    prefix[1, 10:12] = True  # and an island of prefix inside a document
    return Data(
        MaskRows(
            q_pos=torch.arange(T),
            k_pos=torch.arange(T),
            doc_ids=document_ids(starts),
            prefix=prefix,
        )
    )


def packed_data() -> Data:
    """Downstream scoring's rows: a context then continuations that each see the context and
    themselves (`given`), each at the places it has after the context (`places`)."""
    # (context, continuation, continuation) lengths of each row: 15 tokens
    layouts = ([6, 5, 4], [3, 7, 5])
    given, places = [], []
    for context, *continuations in layouts:
        segment = [0] * context
        place = list(range(context))
        for i, n in enumerate(continuations, start=1):
            segment += [i] * n
            place += range(context, context + n)
        given.append(
            [
                [k <= q and (segment[k] == 0 or segment[k] == segment[q]) for k in range(15)]
                for q in range(15)
            ]
        )
        places.append(place)
    return Data(
        MaskRows(
            q_pos=torch.arange(15),
            k_pos=torch.arange(15),
            places=torch.tensor(places),
            given=torch.tensor(given),
        )
    )


def reference(spec: tuple, data: Data) -> torch.Tensor:
    """(B, T, T) whether query q of row b sees key k: every condition of `spec` holds, each
    written out for one pair."""
    doc, prefix = data.lists("doc_ids"), data.lists("prefix")
    places, given = data.lists("places"), data.lists("given")
    B, T = data.rows.batch or 1, data.T

    def holds(condition, b: int, q: int, k: int) -> bool:
        if condition == "causal":
            return k <= q
        if condition == "document":
            return doc[b][q] == doc[b][k]
        if condition == "prefix":
            return k <= q or (prefix[b][q] and prefix[b][k])
        if condition == "given":
            return given[b][q][k]
        kind, size = condition
        assert kind == "window"
        # how far back the key is, in the row's own sequence where rows pack several; a window
        # bounds the look back only (a prefix's later tokens stay visible, as in transformers)
        back = q - k if places is None else places[b][q] - places[b][k]
        return back < size

    return torch.tensor(
        [
            [[all(holds(c, b, q, k) for c in spec) for k in range(T)] for q in range(T)]
            for b in range(B)
        ]
    )


def functions_of(spec: tuple) -> tuple[MaskFunction, ...]:
    made = {
        "causal": Causal(),
        "document": Document(),
        "prefix": PrefixBidirectional(),
        "given": Given(),
    }
    return tuple(made[c] if isinstance(c, str) else SlidingWindow(c[1]) for c in spec)


def windows(*rest: str, sizes=(1, 3, 8, 21, 30)) -> dict[str, tuple]:
    """`rest` with a window of each size: 1 (itself only), inside a tile, a tile of 8, the
    length of the 21-token rows, past every row."""
    return {f"{'+'.join(rest)}+window={n}": (*rest, ("window", n)) for n in sizes}


# the compositions the Transformer builds (tiled: every function has `tiles`)
TILED = {
    "causal": ("causal",),
    "causal+document": ("causal", "document"),
    **windows("causal"),
    **windows("causal", "document"),
}
# a prefix LM's (PrefixBidirectional has no `tiles`: create_block_mask's path)
PREFIX = {
    "prefix": ("prefix",),
    "prefix+document": ("prefix", "document"),
    **windows("prefix", sizes=(3,)),
    **windows("prefix", "document", sizes=(1, 3, 30)),
}
# downstream scoring's packed rows: windows count in `places`
GIVEN = {"given": ("given",), **windows("given", sizes=(1, 3, 8, 30))}
COMPOSITIONS = {**TILED, **PREFIX, **GIVEN}


def cases() -> list:
    out = []
    for name, spec in COMPOSITIONS.items():
        layouts = ["packed"] if name in GIVEN else list(LAYOUTS)
        out += [pytest.param(spec, layout, id=f"{name}-{layout}") for layout in layouts]
    return out


def data_of(layout: str) -> Data:
    return packed_data() if layout == "packed" else layout_data(layout)


def test_the_layouts_are_what_the_reference_reads():
    """The per-row data the cases stand on: documents, prefixes, packed places."""
    data = layout_data("docs")
    assert data.lists("doc_ids")[0] == [0] * 5 + [1] + [2] * 9 + [3] * 6
    assert data.lists("prefix")[0] == [1, 1, 1, 0, 0, 1] + [1, 1, 1] + [0] * 6 + [1, 1, 1, 0, 0, 0]
    packed = packed_data()
    assert packed.lists("places")[0] == [*range(11), *range(6, 10)]
    given = packed.rows.given[0]
    assert given[10, 5] and given[10, 6] and not given[11, 10] and given[14, 11]


# -- the dense mask ----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "layout"), cases())
def test_dense_mask_equals_the_pair_by_pair_reference(spec, layout):
    data = data_of(layout)
    want = reference(spec, data)
    mask = AttentionMask(functions_of(spec), data.rows)
    dense = mask.dense()
    assert dense.dtype == torch.bool and dense.shape == (want.size(0), 1, data.T, data.T)
    assert torch.equal(dense[:, 0], want)
    assert mask.dense() is dense  # made once, for every block that shares the mask


def test_the_windows_cut_something():
    """The references differ where they should: the cases can fail."""
    data = layout_data("docs")
    causal = reference(("causal",), data)
    assert torch.equal(reference(("causal", ("window", 21)), data), causal)
    assert not torch.equal(reference(("causal", ("window", 3)), data), causal)
    assert reference(("causal", ("window", 1)), data).sum() == 2 * 21  # each token sees itself
    assert (reference(("prefix",), data) & ~causal).any()
    packed = packed_data()
    # counted in places, not in the row: the last continuation's first token (place 6, row
    # index 11) sees the context's last 3 tokens with a window of 4
    assert reference(("given", ("window", 4)), packed)[0, 11].tolist() == [
        *([False] * 3), True, True, True, *([False] * 5), True, False, False, False,
    ]  # fmt: skip


# -- the BlockMask -----------------------------------------------------------------------------


def reference_block_mask(want: torch.Tensor, block_size: int):
    """torch's BlockMask of the reference mask: create_block_mask evaluates it at every pair."""

    def mask_mod(b, h, q, k):
        return want[b, q, k]

    B, T, _ = want.shape
    return create_block_mask(mask_mod, B, None, T, T, "cpu", BLOCK_SIZE=block_size)


@pytest.fixture
def pairwise_builds(monkeypatch) -> list:
    """The calls `block_mask` makes to create_block_mask (which evaluates every pair)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return create_block_mask(*args, **kwargs)

    monkeypatch.setattr(attention_masks, "create_block_mask", counted)
    return calls


@pytest.mark.parametrize("block_size", [1, 3, 8, 128])
@pytest.mark.parametrize(("spec", "layout"), cases())
def test_block_mask_equals_create_block_mask_and_the_reference(
    spec, layout, block_size, pairwise_builds
):
    """Tiled from the functions' bounds where every function has them (no pair evaluated),
    else by create_block_mask: the same partial and full tiles, in the same order, both
    directions, as create_block_mask gives for the reference; and mask_mod, which the kernel
    applies inside the partial tiles, is the reference."""
    data = data_of(layout)
    want = reference(spec, data)
    got = block_mask(AttentionMask(functions_of(spec), data.rows), block_size)
    tiled = all(hasattr(fn, "tiles") for fn in functions_of(spec))
    # the model's own compositions never evaluate every pair (at 128k tokens they could not)
    assert tiled or spec not in TILED.values()
    assert len(pairwise_builds) == (0 if tiled else 1)
    expected = reference_block_mask(want, block_size)
    for field in BLOCK_FIELDS:
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    assert got.seq_lengths == (data.T, data.T)
    assert got.BLOCK_SIZE == (block_size, block_size)
    B, T = want.size(0), data.T
    assert torch.equal(create_mask(got.mask_mod, B, 1, T, T, "cpu")[:, 0], want)


def test_random_layouts_and_windows_tile_like_create_block_mask():
    """Documents, windows and block sizes drawn at random: causal + document + window tiled
    from bounds equals create_block_mask of the pair-by-pair reference."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        T = int(torch.randint(1, 40, (), generator=gen))
        block_size = int(torch.randint(1, 10, (), generator=gen))
        size = int(torch.randint(1, T + 3, (), generator=gen))
        starts = torch.rand(2, T, generator=gen) < torch.rand((), generator=gen)
        data = Data(MaskRows(torch.arange(T), torch.arange(T), doc_ids=document_ids(starts)))
        for spec in (("causal", ("window", size)), ("causal", "document", ("window", size))):
            want = reference(spec, data)
            got = block_mask(AttentionMask(functions_of(spec), data.rows), block_size)
            expected = reference_block_mask(want, block_size)
            assert torch.equal(got.to_dense(), expected.to_dense()), (T, block_size, spec)
            assert torch.equal(got.full_kv_num_blocks, expected.full_kv_num_blocks)
            assert torch.equal(got.full_q_num_blocks, expected.full_q_num_blocks)
            B = want.size(0)
            assert torch.equal(create_mask(got.mask_mod, B, 1, T, T, "cpu")[:, 0], want)


# -- attention through FlexAttention -----------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 0.7], ids=["plain", "softcap"])
@pytest.mark.parametrize(("spec", "layout"), [c for c in cases() if "edges" not in c.id])
def test_attend_through_flex_equals_the_dense_path(spec, layout, softcap, monkeypatch):
    """`attend` with the BlockMask (eager FlexAttention, tiles of 8) and with the dense mask
    (SDPA, or the soft-capped attention written out) give the same output, query heads
    sharing key/value heads."""
    data = data_of(layout)
    gen = torch.Generator().manual_seed(2)
    B, T = data.rows.batch, data.T
    q = torch.randn(B, 4, T, 8, generator=gen)
    k, v = torch.randn(2, B, 2, T, 8, generator=gen)
    functions = functions_of(spec)
    dense = attention_masks.attend(q, k, v, AttentionMask(functions, data.rows), softcap=softcap)
    calls = enable_flex(monkeypatch)
    mask = AttentionMask(functions, data.rows)
    mask.block_mask = block_mask(mask, 8)
    flex = attention_masks.attend(q, k, v, mask, softcap=softcap)
    assert len(calls) == 1 and (calls[0] is None) == (softcap is None)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)


# -- a model's logits through FlexAttention ----------------------------------------------------

MHA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, mlp_multiple_of=32)
GQA = {**MHA, "n_kv_heads": 2}


def seeded_model(cls: type[Transformer] = Transformer, **overrides) -> Transformer:
    fields = dict(vocab_size=VOCAB, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    cfg = TransformerConfig(**{**fields, **GQA, "init_std": 0.1, **overrides})
    torch.manual_seed(0)
    model = cls(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def window(size: int, *pattern: str, **options) -> AttentionOptions:
    return AttentionOptions(window=size, pattern=pattern or ("local",), **options)


def doc_layout(*rows: list[int]) -> torch.Tensor:
    return torch.stack([starts_of(row) for row in rows])


# two rows of 37 tokens: documents across tiles of 8, of one token, and a row of one document
STARTS = doc_layout([5, 11, 1, 9, 3, 8], [37])


def enable_flex(monkeypatch) -> list:
    """FlexAttention on CPU (forward only), with tiles small enough that a row spans several;
    returns the list of its calls (their score_mod), so a test sees that it ran."""
    calls = []
    flex = attention_masks.flex_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("score_mod"))
        return flex(*args, **kwargs)

    monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
    monkeypatch.setattr(attention_masks, "BLOCK_SIZE", 8)
    monkeypatch.setattr(attention_masks, "flex_attention", counted)
    return calls


@pytest.fixture
def flex_on(monkeypatch) -> list:
    return enable_flex(monkeypatch)


# name: the model's options, and whether its forward gets document starts
FLEX_CASES = {
    "window": (dict(attention=window(5)), False),
    "window=1": (dict(attention=window(1)), False),
    "window=tile": (dict(attention=window(8), n_kv_heads=None), False),
    "local-global": (dict(attention=window(5, "local", "global")), False),
    "window+doc": (dict(attention=window(5), doc_masking=True), True),
    "global-local+doc": (dict(attention=window(11, "global", "local"), doc_masking=True), True),
    "softcap": (dict(attention=AttentionOptions(softcap=0.5)), False),
    "window+softcap": (dict(attention=window(5, softcap=0.5)), False),
    "local-global+doc+softcap": (
        dict(attention=window(5, "local", "global", softcap=0.5), doc_masking=True),
        True,
    ),
}


@pytest.mark.parametrize(("options", "documents"), FLEX_CASES.values(), ids=FLEX_CASES.keys())
def test_flex_logits_equal_the_dense_path(options, documents, monkeypatch):
    model = seeded_model(**options)
    tokens = torch.randint(0, VOCAB, STARTS.shape, generator=torch.Generator().manual_seed(1))
    starts = STARTS if documents else None
    with torch.no_grad():
        dense = model(tokens, starts)
        calls = enable_flex(monkeypatch)
        flex = model(tokens, starts)
    # every block with a mask went through FlexAttention (a plain causal block without
    # soft-capping keeps SDPA's causal kernel), with the soft-cap as its score_mod
    softcap = model.cfg.attention.softcap
    windowed = [model.cfg.attention.window_of(i) is not None for i in range(2)]
    assert len(calls) == (2 if documents or softcap else sum(windowed))
    assert all((s is None) == (softcap is None) for s in calls)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=0)


def test_softcap_and_windows_change_the_logits():
    """The flex cases compare paths that could differ: each option moves the logits."""
    tokens = torch.randint(0, VOCAB, STARTS.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = seeded_model()(tokens)
        for options in (window(5), window(5, "global", "local"), AttentionOptions(softcap=0.5)):
            assert (seeded_model(attention=options)(tokens) - plain).abs().max() > 1e-3, options


# name: the model's options and whether forward gets prefix flags (the compositions compiled)
COMPILED = {
    "documents": (dict(doc_masking=True), False),
    "window": (dict(attention=window(6)), False),
    "documents+window+softcap": (dict(attention=window(6, softcap=0.5), doc_masking=True), False),
    "prefix+documents+window": (dict(attention=window(6), doc_masking=True), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_flex_equals_the_dense_path_without_recompiling(name, monkeypatch):
    """Compiled per block as `parallel.compile` does (inductor's FlexAttention kernel, which
    skips empty tiles and applies no mask inside full ones), each composition gives the dense
    logits, and rows with other documents and prefixes reuse the compiled graph (the mask's
    tensors are graph inputs, not constants)."""
    options, with_prefix = COMPILED[name]
    model = seeded_model(n_layers=1, **options)
    tokens = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))
    rows = [([37], [1] * 37), ([8, 8, 16, 5], [7, 9, 15, 6])]
    inputs = [dict(doc_starts=STARTS)] + [dict(doc_starts=doc_layout(*r)) for r in rows]
    if with_prefix:  # islands of prefix, other ones in each batch
        for seed, given in enumerate(inputs):
            gen = torch.Generator().manual_seed(seed)
            given["prefix"] = torch.rand(2, 37, generator=gen) < 0.3
    with torch.no_grad():
        dense = [model(tokens, **given) for given in inputs]
        monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
        monkeypatch.setattr(attention_masks, "BLOCK_SIZE", 8)
        torch._dynamo.reset()
        for block in model.blocks.values():
            block.compile(fullgraph=True)
        compiled = [model(tokens, **inputs[0])]
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled += [model(tokens, **given) for given in inputs[1:]]
    for got, want in zip(compiled, dense, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


# -- which blocks get which mask ----------------------------------------------------------------


def masks_of(model: Transformer, tokens: torch.Tensor, starts: torch.Tensor | None):
    _, masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)
    return masks


def test_blocks_with_the_same_functions_share_one_mask(flex_on):
    model = seeded_model(n_layers=4, attention=window(4, "local", "global"), doc_masking=True)
    tokens = torch.zeros(STARTS.shape, dtype=torch.long)
    local, glob = (Causal(), Document(), SlidingWindow(4)), (Causal(), Document())
    assert model.layer_masks(True) == [local, glob, local, glob]
    assert model.layer_masks(False) == [(Causal(), SlidingWindow(4)), (Causal(),)] * 2
    masks = masks_of(model, tokens, STARTS)
    assert masks[0] is masks[2] and masks[1] is masks[3] and masks[0] is not masks[1]
    assert (masks[0].functions, masks[1].functions) == (local, glob)
    # one BlockMask per distinct mask, over the forward's documents
    assert masks[0].block_mask is masks[2].block_mask is not None
    assert masks[1].block_mask is not None and masks[1].block_mask is not masks[0].block_mask
    assert torch.equal(masks[0].rows.doc_ids, document_ids(STARTS))
    # without documents, the global blocks keep SDPA's causal kernel (no mask at all)
    masks = masks_of(model, tokens, None)
    assert masks[1] is None and masks[3] is None
    assert masks[0] is masks[2] and masks[0].functions == (Causal(), SlidingWindow(4))
    # soft-capped scores need a mask object in every block: the global ones share a causal one
    capped = seeded_model(n_layers=4, attention=window(4, "local", "global", softcap=30.0))
    masks = masks_of(capped, tokens, None)
    assert masks[1] is masks[3] and masks[1].functions == (Causal(),)
    assert masks[0] is masks[2] and masks[0] is not masks[1]


def test_a_plain_model_needs_no_mask():
    model = seeded_model(n_layers=3)
    assert masks_of(model, torch.zeros(2, 9, dtype=torch.long), None) == [None] * 3


@pytest.mark.parametrize(
    ("pattern", "n_layers", "local"),
    [
        (("local",), 3, [True, True, True]),
        (("local", "global"), 5, [True, False, True, False, True]),
        # Gemma 3: five local blocks then a global one, repeated from the first block
        (("local",) * 5 + ("global",), 8, [True] * 5 + [False] + [True] * 2),
        # a list as long as the model gives each block its own
        (("global", "local", "local"), 3, [False, True, True]),
    ],
)
def test_a_pattern_gives_each_block_its_functions(pattern, n_layers, local):
    with torch.device("meta"):
        model = seeded_model(n_layers=n_layers, attention=window(4, *pattern))
    want = [(Causal(), SlidingWindow(4)) if is_local else (Causal(),) for is_local in local]
    assert model.layer_masks(False) == want
    assert [model.cfg.attention.window_of(i) for i in range(n_layers)] == [
        4 if is_local else None for is_local in local
    ]


def test_describe_names_each_blocks_functions_and_the_score_mod():
    model = seeded_model(n_layers=3, attention=window(4, "local", "global"), doc_masking=True)
    attention = model.describe().attention
    assert attention.layers == (
        ("causal", "document", "window=4"),
        ("causal", "document"),
        ("causal", "document", "window=4"),
    )
    assert attention.score_mod is None
    assert attention.document_masking and not attention.plain_causal
    capped = seeded_model(n_layers=2, attention=AttentionOptions(softcap=50.0)).describe()
    assert capped.attention.layers == (("causal",), ("causal",))
    assert capped.attention.score_mod == "softcap=50.0"
    assert not capped.attention.plain_causal
    assert seeded_model(n_layers=2).describe().attention.plain_causal


# -- downstream scoring's packed rows: the given mask, windows counted in places ---------------


@pytest.mark.parametrize("pattern", [("local",), ("local", "global")])
def test_packed_continuations_with_windows_equal_their_own_rows(pattern):
    """A row of context + two continuations (each at the places it has after the context, the
    explicit mask letting it see the context and itself) gives each continuation the logits of
    its own row: the windows count distance in places, not along the packed row."""
    model = seeded_model(attention=window(4, *pattern), max_seq_len=16)
    gen = torch.Generator().manual_seed(9)
    context, first, second = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (10, 5, 6))
    row = torch.cat([context, first, second]).unsqueeze(0)
    positions = torch.cat([torch.arange(15), torch.arange(10, 16)]).unsqueeze(0)
    segment = torch.tensor([0] * 10 + [1] * 5 + [2] * 6)
    causal = torch.ones(21, 21, dtype=torch.bool).tril()
    mask = causal & ((segment.unsqueeze(0) == 0) | (segment.unsqueeze(0) == segment.unsqueeze(1)))
    with torch.no_grad():
        packed = model(row, positions=positions, attention_mask=mask.unsqueeze(0))[0]
        alone_first = model(torch.cat([context, first]).unsqueeze(0))[0]
        alone_second = model(torch.cat([context, second]).unsqueeze(0))[0]
    torch.testing.assert_close(packed[:15], alone_first, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[15:], alone_second[10:], atol=1e-5, rtol=0)
    # and the window does cut: the second continuation's first token (place 10) sees the
    # context's last 3 tokens and itself
    _, masks = model._positions_and_masks(row, None, None, 0, positions, mask[None], None)
    assert masks[0].functions == (Given(), SlidingWindow(4))
    seen = [False] * 7 + [True] * 3 + [False] * 5 + [True] + [False] * 5
    assert masks[0].dense()[0, 0, 15].tolist() == seen


# -- a mask function a model brings ------------------------------------------------------------


@attrs.frozen
class EvenDistance:
    """A third party's mask function: keys an even distance back only (in the row's own
    sequence, so packed rows count in places). No `tiles`: create_block_mask classifies it."""

    name = "even-distance"

    def __call__(self, rows: MaskRows, b, q, k) -> torch.Tensor:
        return rows.distance(b, q, k) % 2 == 0


class EvenDistanceTransformer(Transformer):
    """What a plugin's model does to bring its own mask: add its function in `layer_masks`."""

    def layer_masks(self, documents: bool) -> list[tuple[MaskFunction, ...]]:
        return [(*functions, EvenDistance()) for functions in super().layer_masks(documents)]


def even_distance_reference(starts: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    doc = [[0] * T] * B if starts is None else document_ids(starts).tolist()
    return torch.tensor(
        [
            [[k <= q and (q - k) % 2 == 0 and row[q] == row[k] for k in range(T)] for q in range(T)]
            for row in doc
        ]
    )


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_a_models_own_mask_function_runs_on_both_paths(documents, monkeypatch):
    """The subclass's logits, dense and through FlexAttention, equal the plain model's given
    the reference mask explicitly (positions + attention_mask)."""
    options = dict(doc_masking=documents, attention=window(9, "local", "global"))
    model = seeded_model(EvenDistanceTransformer, **options)
    plain = seeded_model(Transformer, **options)
    assert isinstance(EvenDistance(), MaskFunction) and EvenDistance() == EvenDistance()
    starts = STARTS if documents else None
    B, T = STARTS.shape
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(4))
    want_mask = even_distance_reference(starts, B, T)
    positions = torch.arange(T)[None] if starts is None else positions_in_document(starts)
    with torch.no_grad():
        # the plain model applies its windows to the given mask, counting in positions
        want = plain(tokens, positions=positions, attention_mask=want_mask)
        dense = model(tokens, starts)
        calls = enable_flex(monkeypatch)
        flex = model(tokens, starts)
    assert len(calls) == 2
    torch.testing.assert_close(dense, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(flex, want, atol=2e-5, rtol=0)
    # the mask changes the function: the model is not the plain one
    with torch.no_grad():
        assert (plain(tokens, starts) - want).abs().max() > 1e-3
    document = ("document",) if documents else ()
    assert model.describe().attention.layers == (
        ("causal", *document, "window=9", "even-distance"),
        ("causal", *document, "even-distance"),
    )
    _, masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)
    assert torch.equal(masks[1].dense()[:, 0].expand(B, T, T), want_mask)
