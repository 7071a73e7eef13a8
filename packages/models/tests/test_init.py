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


def _residual_writers(model: Transformer, cfg: TransformerConfig) -> list[set[torch.nn.Linear]]:
    """Per block, the two Linear layers whose outputs are added to the residual stream.

    Found by call order, not by name or shape (the attention's q and output projections are both
    d x d): the attention output projection is the last Linear called before the MLP's first one
    (the first with `hidden_size` outputs), the MLP output projection is the block's last Linear.
    """
    calls: list[torch.nn.Linear] = []
    blocks = list(model.describe().blocks)
    linears = [m for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append(m)) for m in linears]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    finally:
        for hook in hooks:
            hook.remove()
    writers = []
    for block in blocks:
        own = set(block.modules())
        in_block = [m for m in calls if m in own]
        first_mlp = next(i for i, m in enumerate(in_block) if m.out_features == cfg.hidden_size)
        writers.append({in_block[first_mlp - 1], in_block[-1]})
    return writers


@pytest.mark.parametrize("scale_residual_init", [True, False])
def test_init_std_and_scaled_residual_projections(scale_residual_init):
    cfg = TransformerConfig(**MID, scale_residual_init=scale_residual_init)
    model = from_meta(cfg, seed=3)
    scale = 1 / math.sqrt(2 * cfg.n_layers) if scale_residual_init else 1.0
    d, hidden = cfg.d_model, cfg.hidden_size

    def assert_std(p: torch.Tensor, want: float, what: str) -> None:
        std = p.std().item()
        assert abs(std - want) < 0.1 * want, (what, std, want)
        assert abs(p.mean().item()) < 6 * std / math.sqrt(p.numel()), what

    assert_std(model.tok_emb.weight, cfg.init_std, "tok_emb")
    for block, writers in zip(model.describe().blocks, _residual_writers(model, cfg), strict=True):
        assert sorted(tuple(m.weight.shape) for m in writers) == sorted([(d, d), (d, hidden)])
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear):
                want = cfg.init_std * (scale if module in writers else 1.0)
                assert_std(module.weight, want, name)
        for name, p in block.named_parameters():
            if p.ndim == 1:
                assert torch.equal(p, torch.ones_like(p)), f"{name}: norm weights start at one"
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
