"""Document masking without a dense mask: the BlockMask's tiles, FlexAttention against the dense
SDPA reference (eager; compiled in test_attention_masks.py), the mask's memory, and the paths that keep SDPA.

FlexAttention runs on CUDA only (CPU FlexAttention has no backward), so these tests switch it on
for CPU (`flex_on`) and compare forward logits under no_grad; gradients through the CUDA kernel
are checked in integration_tests/test_gpu_document_masking.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.models import attention_masks
from llmtrain.models.attention_masks import (
    AttentionMask,
    Causal,
    Document,
    MaskRows,
    block_mask,
    document_ids,
    positions_in_document,
)
from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import Transformer

VOCAB = 128
MHA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, mlp_multiple_of=32)
GQA = {**MHA, "n_kv_heads": 2}
HEADS = pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
# the eager FlexAttention these tests compare is the reference torch warns about, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def starts_of(lengths: list[int]) -> torch.Tensor:
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return starts


# name: the document lengths of each of two rows
LAYOUTS = {
    "one_document": ([37], [37]),
    "many": ([5, 11, 1, 9, 3, 8], [2, 17, 18]),
    "start_at_0_only": ([37], [1, 36]),
    "length_1": ([1] * 37, [1, 1, 30, 1, 1, 1, 1, 1]),
    "block_edges": ([8, 8, 16, 5], [7, 9, 15, 6]),
}


def layout(name: str) -> torch.Tensor:
    return torch.stack([starts_of(row) for row in LAYOUTS[name]])


def reference_mask(starts: torch.Tensor) -> torch.Tensor:
    """(B, T, T) same document and not in the future, pair by pair."""
    doc = document_ids(starts).tolist()
    T = starts.size(1)
    return torch.tensor(
        [[[row[q] == row[k] and k <= q for k in range(T)] for q in range(T)] for row in doc]
    )


def document_mask(starts: torch.Tensor) -> AttentionMask:
    """The AttentionMask of document masking over the whole rows (what a forward builds)."""
    T = starts.size(1)
    rows = MaskRows(q_pos=torch.arange(T), k_pos=torch.arange(T), doc_ids=document_ids(starts))
    return AttentionMask((Causal(), Document()), rows)


def torch_block_mask(doc: torch.Tensor, block_size: int):
    """torch's own BlockMask for the documents `doc` (B, T): create_block_mask evaluates the mask
    at every (query, key) pair, then reduces it tile by tile."""

    def same_document_causal(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (q >= k)

    B, T = doc.shape
    return create_block_mask(same_document_causal, B, None, T, T, "cpu", BLOCK_SIZE=block_size)


@pytest.fixture
def flex_on(monkeypatch):
    """FlexAttention on CPU (forward only), with blocks small enough that a row spans several."""
    monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
    monkeypatch.setattr(attention_masks, "BLOCK_SIZE", 8)


def seeded_model(heads: dict, **overrides) -> Transformer:
    fields = dict(vocab_size=VOCAB, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    cfg = TransformerConfig(**{**fields, **heads, "init_std": 0.1, **overrides})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


# -- the mask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [1, 3, 8, 128])
def test_block_mask_tiles_equal_create_block_mask(name, block_size):
    """Tile by tile from the document indices gives what torch's create_block_mask computes from
    the (T, T) mask: the same partial and full tiles, in the same order, both directions."""
    starts = layout(name)
    doc = document_ids(starts)
    got = block_mask(document_mask(starts), block_size)
    want = torch_block_mask(doc, block_size)
    B, T = starts.shape
    for field in (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
        "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
    ):  # fmt: skip
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.seq_lengths == (T, T)
    # and mask_mod, which the kernels apply inside partial tiles, is the definition
    dense = create_mask(got.mask_mod, B, 1, T, T, "cpu")
    assert torch.equal(dense[:, 0], reference_mask(starts))


def test_random_layouts_tile_like_create_block_mask():
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        T = int(torch.randint(1, 50, (), generator=gen))
        block_size = int(torch.randint(1, 10, (), generator=gen))
        starts = torch.rand(3, T, generator=gen) < torch.rand((), generator=gen)
        doc = document_ids(starts)
        got = block_mask(document_mask(starts), block_size)
        want = torch_block_mask(doc, block_size)
        assert torch.equal(got.to_dense(), want.to_dense())
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
        assert torch.equal(got.full_q_num_blocks, want.full_q_num_blocks)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dense_mask_and_positions_follow_the_documents(name):
    starts = layout(name)
    model = seeded_model(GQA, doc_masking=True, max_seq_len=starts.size(1))
    tokens = torch.zeros(starts.shape, dtype=torch.long)
    _, masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)
    mask = masks[0]  # on CPU: the dense form only, one object for every block
    assert all(m is mask for m in masks) and mask.block_mask is None
    assert torch.equal(mask.dense()[:, 0], reference_mask(starts))
    assert mask.dense() is mask.dense()  # built once per forward, shared by the layers
    positions = positions_in_document(starts)
    for row, lengths in zip(positions.tolist(), LAYOUTS[name], strict=True):
        assert row == [p for n in lengths for p in range(n)]


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("T", [2048, 8192])
def test_the_block_mask_never_holds_a_t_by_t_tensor(T, monkeypatch):
    """Built for FlexAttention, the mask's largest tensor is O(B T + B (T / 128)^2): 8192 tokens
    make 64 x 64 tiles where the dense mask would be 8192 x 8192."""
    monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
    B, n = 2, T // 128
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(B, T, generator=gen) < 1 / 300
    model = seeded_model(GQA, doc_masking=True, max_seq_len=T)
    tokens = torch.zeros(B, T, dtype=torch.long)
    with LargestTensor() as largest:
        positions, masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)
    mask = masks[0]
    assert all(m is mask for m in masks)
    assert isinstance(mask, AttentionMask) and mask._dense is None
    assert positions.shape == (B, T)
    assert largest.numel <= B * max(T, n * (n + 1))
    tensors = [x for x in mask.block_mask.as_tuple() if isinstance(x, torch.Tensor)]
    assert sum(x.numel() for x in tensors) <= 8 * B * n * n + 8 * B * n


# -- FlexAttention against the dense reference (forward; CPU FlexAttention has no backward) ------


@HEADS
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flex_logits_equal_the_dense_mask(heads, name, monkeypatch):
    model = seeded_model(heads, doc_masking=True)
    starts = layout(name)
    tokens = torch.randint(0, VOCAB, starts.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(tokens, starts)
        monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: True)
        monkeypatch.setattr(attention_masks, "BLOCK_SIZE", 8)
        flex = model(tokens, starts)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=0)


@HEADS
def test_doc_masking_equals_explicit_positions_and_mask_with_gradients(heads):
    """The model's own doc masking against its `positions` + `attention_mask` path (SDPA with
    a (B, T, T) mask the test writes pair by pair): logits and every parameter's gradient."""
    starts = layout("many")
    tokens = torch.randint(0, VOCAB, starts.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for inputs in (
        dict(doc_starts=starts),
        dict(positions=positions_in_document(starts), attention_mask=reference_mask(starts)),
    ):
        model = seeded_model(heads, doc_masking=True).train()
        logits = model(tokens, **inputs)
        (logits.float().square().mean()).backward()
        grads.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (got, got_grads), (want, want_grads) = grads
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


# compiled per block: test_attention_masks.py's compiled test runs documents with a window


# -- where SDPA stays ----------------------------------------------------------------------------


def test_dropout_falls_back_to_the_dense_mask(flex_on):
    """FlexAttention has no dropout: a training step with dropout takes SDPA and its dense mask
    (CPU FlexAttention would refuse the backward)."""
    model = seeded_model(GQA, doc_masking=True, dropout=0.1).train()
    starts = layout("many")
    tokens = torch.randint(0, VOCAB, starts.shape, generator=torch.Generator().manual_seed(4))
    model(tokens, starts).float().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cache_and_explicit_masks_never_build_a_document_mask(flex_on):
    """Decoding with a cache and the attention_mask path keep their boolean masks."""
    model = seeded_model(GQA, doc_masking=True)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(1, 12)
        first = model(tokens[:, :8], cache=cache)
        rest = model(tokens[:, 8:], cache=cache, start_pos=8)
        explicit = model(
            tokens,
            positions=torch.arange(12)[None],
            attention_mask=torch.ones(12, 12, dtype=torch.bool).tril()[None],
        )
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="decode one document at a time"):
        model(tokens, layout("many")[:1, :12], cache=model.new_cache(1, 12))
