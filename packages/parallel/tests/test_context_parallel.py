"""Context parallelism's arithmetic in one process: which positions each rank holds, that
attention over gathered keys with the global causal mask is the plain causal attention, and that
a model's own mask over every key (documents, windows) gets the keys in position order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.parallel import context_parallel
from llmtrain.parallel.context_parallel import attention_over, shard_index


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize(("seq_len", "size"), [(8, 1), (8, 2), (16, 4), (24, 3), (64, 8)])
def test_shards_of_all_ranks_are_a_permutation(seq_len, size, load_balance):
    shards = [shard_index(seq_len, r, size, load_balance) for r in range(size)]
    assert all(s.dtype == torch.int64 and s.numel() == seq_len // size for s in shards)
    assert sorted(torch.cat(shards).tolist()) == list(range(seq_len))


@pytest.mark.parametrize(("seq_len", "size"), [(8, 2), (16, 4), (24, 3), (64, 8), (12, 1)])
def test_load_balance_gives_every_rank_the_same_causal_work(seq_len, size):
    # a query at position p attends over p + 1 keys
    work = [int((shard_index(seq_len, r, size, True) + 1).sum()) for r in range(size)]
    assert len(set(work)) == 1
    assert sum(work) == seq_len * (seq_len + 1) // 2
    # without load balancing the last rank does most of the work
    plain = [int((shard_index(seq_len, r, size, False) + 1).sum()) for r in range(size)]
    if size > 1:
        assert plain == sorted(plain) and plain[0] < plain[-1]


def test_shard_examples():
    assert shard_index(8, 0, 2, True).tolist() == [0, 1, 6, 7]
    assert shard_index(8, 1, 2, True).tolist() == [2, 3, 4, 5]
    assert shard_index(8, 0, 2, False).tolist() == [0, 1, 2, 3]
    assert shard_index(8, 1, 2, False).tolist() == [4, 5, 6, 7]
    assert shard_index(12, 2, 3, True).tolist() == [4, 5, 6, 7]


class FakeGather:
    """Stands in for the cp group's all-gather: returns the whole key or value tensor (of which
    it gets a shard) in rank order, each rank's positions in its own order, as gloo would."""

    def __init__(self, full: list[torch.Tensor], shards: list[torch.Tensor]):
        self.full, self.shards = full, shards
        self.calls = 0

    def __call__(self, shard, gather_dim, group):
        assert gather_dim == 2 and group == "cp-group"
        self.calls += 1
        for tensor in self.full:
            if any(torch.equal(shard, tensor.index_select(2, idx)) for idx in self.shards):
                return tensor.index_select(2, torch.cat(self.shards))
        raise AssertionError("gathered a tensor that is not a shard of k or v")


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("size", [2, 4])
def test_gathered_attention_equals_causal_attention(monkeypatch, size, load_balance):
    B, H, T, D = 2, 3, 16, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    weight = torch.randn(B, H, T, D, generator=g)

    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (expected * weight).sum().backward()
    expected_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    shards = [shard_index(T, r, size, load_balance) for r in range(size)]
    fake = FakeGather([k, v], shards)
    monkeypatch.setattr(context_parallel, "all_gather_tensor_autograd", fake)
    total = torch.zeros(())
    for rank, index in enumerate(shards):
        with attention_over("cp-group", T, rank, size, load_balance, "cpu"):
            out = F.scaled_dot_product_attention(
                q[:, :, index], k[:, :, index], v[:, :, index], is_causal=True
            )
        torch.testing.assert_close(out, expected[:, :, index].detach())
        total = total + (out * weight[:, :, index]).sum()
    assert fake.calls == 2 * size  # keys and values, once per rank
    total.backward()
    for got, want in zip((q.grad, k.grad, v.grad), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def masks_over_positions(T: int, window: int | None, seed: int = 1) -> torch.Tensor:
    """(B=2, 1, T, T): causal, within each row's documents, and within `window` (if any)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(2, T, generator=g) < 0.2
    starts[:, 0] = starts[0, T // 2 + 1] = starts[1, 3] = True
    doc = starts.cumsum(dim=1)
    pos = torch.arange(T)
    mask = (pos.view(-1, 1) >= pos.view(1, -1)) & (doc.unsqueeze(2) == doc.unsqueeze(1))
    if window is not None:
        mask = mask & (pos.view(-1, 1) - pos.view(1, -1) < window)
    return mask.unsqueeze(1)


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_gathered_attention_takes_the_models_mask_over_every_key(
    monkeypatch, size, load_balance, window
):
    # what the model does under cp with document masking or windows: a mask over its queries and
    # every key of the sequence in position order; keys arrive in rank order and are put back
    B, H, KV, T, D = 2, 4, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, KV, T, D, generator=g, requires_grad=True) for _ in range(2))
    weight = torch.randn(B, H, T, D, generator=g)
    mask = masks_over_positions(T, window)
    sdpa = {"scale": 0.3, "enable_gqa": True}

    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa)
    (expected * weight).sum().backward()
    expected_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    # guard: the mask is neither causal attention nor the same with another scale
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(causal, expected)

    shards = [shard_index(T, r, size, load_balance) for r in range(size)]
    fake = FakeGather([k, v], shards)
    monkeypatch.setattr(context_parallel, "all_gather_tensor_autograd", fake)
    total = torch.zeros(())
    for rank, index in enumerate(shards):
        with attention_over("cp-group", T, rank, size, load_balance, "cpu"):
            out = F.scaled_dot_product_attention(
                q[:, :, index],
                k[:, :, index],
                v[:, :, index],
                mask[:, :, index],  # positionally, as a model may pass it
                is_causal=False,
                **sdpa,
            )
        torch.testing.assert_close(out, expected[:, :, index].detach())
        total = total + (out * weight[:, :, index]).sum()
    assert fake.calls == 2 * size
    total.backward()
    for got, want in zip((q.grad, k.grad, v.grad), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_attention_other_than_the_two_forms_is_refused(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    monkeypatch.setattr(
        context_parallel, "all_gather_tensor_autograd", lambda t, gather_dim, group: t
    )
    own_keys = torch.ones(4, 4, dtype=torch.bool)
    with attention_over("cp-group", 8, 0, 2, True, "cpu"):
        with pytest.raises(RuntimeError, match="this call has a mask over only this rank's 4"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=own_keys)
        with pytest.raises(RuntimeError, match="this call has no mask and is_causal=False"):
            F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(RuntimeError, match="both a mask and is_causal=True"):
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(4, 8, dtype=torch.bool), is_causal=True
            )
        # a mask over more keys than the sequence has, or over other queries
        for shape in ((4, 12), (3, 8)):
            with pytest.raises(RuntimeError, match=r"must cover this rank's 4 queries and every"):
                F.scaled_dot_product_attention(
                    q, k, v, attn_mask=torch.ones(*shape, dtype=torch.bool)
                )


def test_only_attention_is_replaced(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(
        context_parallel, "all_gather_tensor_autograd", lambda t, gather_dim, group: t
    )
    with attention_over(None, 4, 0, 1, True, "cpu"):
        # other functions pass through untouched
        assert torch.equal(torch.add(q, 1), q + 1)
        # a group of one sees the whole sequence: plain causal attention
        torch.testing.assert_close(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), expected
        )
    # outside the context attention is torch's again
    mask = torch.ones(4, 4, dtype=torch.bool)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        F.scaled_dot_product_attention(q, k, v),
    )
