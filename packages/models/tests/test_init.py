"""Weight initialisation: meta-device construction, the init statistics, reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from llmtrain.models.config import TransformerConfig
from llmtrain.models.transformer import Transformer

# mid-size, so that per-tensor statistics are stable; bias=False: every 1-D parameter is a norm weight
MID = dict(
    vocab_size=256,
    max_seq_len=128,
    d_model=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    positions="rope",
    norm="rmsnorm",
    mlp="swiglu",
    qk_norm=True,
    tied_embeddings=False,
    bias=False,
)


def eager(cfg: TransformerConfig, seed: int) -> Transformer:
    torch.manual_seed(1234)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def from_meta(cfg: TransformerConfig, seed: int | None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(None if seed is None else torch.Generator().manual_seed(seed))
    return model


@pytest.fixture(scope="module")
def mid_cfg() -> TransformerConfig:
    return TransformerConfig(**MID)


def test_meta_init_has_the_statistics_of_eager_init(mid_cfg):
    a = dict(eager(mid_cfg, seed=1).named_parameters())
    b = dict(from_meta(mid_cfg, seed=2).named_parameters())
    assert a.keys() == b.keys()
    for name, pa in a.items():
        pb = b[name]
        assert pa.shape == pb.shape, name
        assert pb.device.type == "cpu" and pb.dtype == torch.float32, name
        assert torch.isfinite(pb).all(), name
        sa, sb = pa.std().item(), pb.std().item()
        assert abs(sa - sb) <= 0.05 * max(sa, sb) + 1e-6, (name, sa, sb)
        bound = 6 * max(sa, sb) / math.sqrt(pa.numel()) + 1e-6
        assert abs(pa.mean().item() - pb.mean().item()) <= bound, name
        assert not torch.equal(pa, pb) or sa == 0, name  # different seeds, different draws


@pytest.mark.parametrize("scale_residual_init", [True, False])
def test_init_std_and_scaled_residual_projections(scale_residual_init):
    cfg = TransformerConfig(**MID, scale_residual_init=scale_residual_init)
    model = from_meta(cfg, seed=3)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if scale_residual_init else None
    d, hidden = cfg.d_model, cfg.hidden_size

    def close(std: float, want: float) -> bool:
        return abs(std - want) < 0.1 * want

    assert close(model.tok_emb.weight.std().item(), cfg.init_std)
    for block in model.blocks:
        scaled = []
        for name, p in block.named_parameters():
            if p.ndim == 1:
                assert torch.equal(p, torch.ones_like(p)), f"{name}: norm weights start at one"
                continue
            std = p.std().item()
            assert abs(p.mean().item()) < 3 * std / math.sqrt(p.numel()) * 2, name
            if residual_std is not None and close(std, residual_std):
                scaled.append(tuple(p.shape))
            else:
                assert close(std, cfg.init_std), (name, std)
        # exactly the two projections that write into the residual stream are scaled down
        want = sorted([(d, d), (d, hidden)]) if scale_residual_init else []
        assert sorted(scaled) == want
    assert torch.equal(model.norm.weight, torch.ones(d))


def test_meta_then_init_equals_eager_then_init(mid_cfg):
    """Same generator seed, same weights and buffers, whichever device the model was built on."""
    a, b = eager(mid_cfg, seed=5), from_meta(mid_cfg, seed=5)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb), na
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name, buf in buffers_a.items():
        assert torch.isfinite(buffers_b[name]).all(), name
        torch.testing.assert_close(buffers_b[name], buf, atol=0, rtol=0)
    tokens = torch.randint(0, mid_cfg.vocab_size, (2, 32))
    with torch.no_grad():
        la, lb = a(tokens), b(tokens)
    assert torch.isfinite(lb).all()
    torch.testing.assert_close(lb, la, atol=0, rtol=0)


def test_meta_init_without_a_generator_and_learned_positions():
    cfg = TransformerConfig(
        vocab_size=100, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, bias=True
    )
    model = from_meta(cfg, seed=None)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "cpu", name
        assert torch.isfinite(t).all(), name
    assert abs(model.pos_emb.weight.std().item() - cfg.init_std) < 0.1 * cfg.init_std
    with torch.no_grad():
        logits = model(torch.randint(0, 100, (2, 64)))
    assert torch.isfinite(logits).all()
    # small init: the first prediction is close to uniform over the padded vocabulary
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.randint(0, 100, (128,))
    )
    assert abs(loss.item() - math.log(cfg.padded_vocab_size)) < 0.2


def test_same_generator_seed_gives_identical_weights(mid_cfg):
    model = eager(mid_cfg, seed=7)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights(torch.Generator().manual_seed(11))
    other = model.state_dict()
    assert not torch.equal(other["tok_emb.weight"], first["tok_emb.weight"])
    model.init_weights(torch.Generator().manual_seed(7))
    again = model.state_dict()
    assert first.keys() == again.keys()
    for name, value in first.items():
        assert torch.equal(again[name], value), name
