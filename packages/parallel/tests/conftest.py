"""Shared test setup for the parallel package: a tiny decoder that describes itself.

The parallel package must work on any model that fills in `ModelDescription`, so these tests
never import llmtrain.models: `ToyDecoder` is a small pre-norm decoder (learned positions,
grouped-query causal attention through scaled_dot_product_attention, a GELU MLP, a final norm and
an output head) written here for the purpose. It can also mask documents and give every other
block a sliding window, building its masks as context parallelism asks of a model whose attention
is not plain causal: over its queries' `positions` and every key of `sequence_length`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from shared_fixtures import one_torch_thread  # noqa: F401
from torch import nn

from llmtrain.core_mesh.interfaces import AttentionDescription, ModelDescription


@attrs.frozen(kw_only=True)
class ToyConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq_len: int = 32
    dropout: float = 0.0
    tied_embeddings: bool = False
    can_trim: bool = True
    # what describe() says of the forward's `doc_starts` masking (the forward masks documents
    # whenever it is given them)
    doc_masking: bool = False
    # blocks 0, 2, ... (the pattern [local, global]) see the `window` most recent keys
    window: int | None = None

    def window_of(self, block: int) -> int | None:
        return self.window if block % 2 == 0 else None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T = x.shape[:2]
        # head counts from the tensors, so a tensor-parallel shard of the weights works too
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        repeat = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.drop(self.wo(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.gelu(self.w1(x))))


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), mask)
        return h + self.mlp(self.mlp_norm(h))


class ToyDecoder(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim)
        self.head: nn.Linear | None = (
            None if cfg.tied_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        tokens: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        sequence_length: int | None = None,
        head_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for tokens (B, T); hidden states in and out on pipeline stages.

        `doc_starts` (B, T, bool) limits attention to the token's own document. `positions`
        (1 or B, T) are the tokens' places in their sequence, and `sequence_length` its length
        where the tokens are a shard of it (context parallelism: `doc_starts` are then the whole
        sequence's). `head_fn(hidden, output matrix)` is returned in place of the logits."""
        T = tokens.size(1)
        if positions is None:
            positions = torch.arange(T, device=tokens.device).unsqueeze(0)
        masks = {
            window: self._mask(positions, doc_starts, sequence_length, window)
            for window in {self.cfg.window_of(int(name)) for name in self.blocks}
        }
        if self.tok_emb is None:
            h = tokens
        else:
            h = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for name, block in self.blocks.items():
            h = block(h, masks[self.cfg.window_of(int(name))])
        if self.norm is None:
            return h
        h = self.norm(h)
        if head_fn is not None:
            return head_fn(h, self.head.weight if self.head is not None else self.tok_emb.weight)
        return self.head(h) if self.head is not None else F.linear(h, self.tok_emb.weight)

    @staticmethod
    def _mask(
        positions: torch.Tensor,
        doc_starts: torch.Tensor | None,
        sequence_length: int | None,
        window: int | None,
    ) -> torch.Tensor | None:
        """(B or 1, 1, queries, keys) may a query see a key, the keys every position of the
        sequence in order; None where attention is plain causal over the tokens given."""
        if doc_starts is None and window is None and sequence_length is None:
            return None
        keys = torch.arange(sequence_length or positions.size(-1), device=positions.device)
        q, k = positions.unsqueeze(-1), keys.view(1, 1, -1)
        mask = k <= q
        if window is not None:
            mask = mask & (q - k < window)
        if doc_starts is not None:
            starts = doc_starts.to(torch.bool).clone()
            starts[:, 0] = True
            segment = starts.cumsum(dim=1)  # (B, T) of the whole sequence
            of_query = segment.gather(1, positions.expand(segment.size(0), -1))
            mask = mask & (of_query.unsqueeze(-1) == segment.unsqueeze(1))
        return mask.unsqueeze(1)

    def trim_to_stage(self, block_ids: Sequence[int], first: bool, last: bool) -> None:
        keep = {str(i) for i in block_ids}
        for name in [n for n in self.blocks if n not in keep]:
            del self.blocks[name]
        if not first:
            self.tok_emb = self.pos_emb = None
        if not last:
            self.norm = self.head = None

    def tp_plan(self) -> dict[str, str]:
        plan = {
            "tok_emb": "embedding",
            "pos_emb": "embedding",
            "blocks.*.attn_norm": "sequence_parallel",
            "blocks.*.attn": "gather_input",
            "blocks.*.attn.wq": "colwise",
            "blocks.*.attn.wk": "colwise",
            "blocks.*.attn.wv": "colwise",
            "blocks.*.attn.wo": "rowwise",
            "blocks.*.mlp_norm": "sequence_parallel",
            "blocks.*.mlp": "gather_input",
            "blocks.*.mlp.w1": "colwise",
            "blocks.*.mlp.w2": "rowwise",
            "norm": "sequence_parallel",
        }
        if self.head is not None:
            plan["head"] = "colwise_output"
        return plan

    def describe(self) -> ModelDescription:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.parameters())
        non_embedding = n_params - self.tok_emb.weight.numel() - self.pos_emb.weight.numel()
        attention_flops = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim

        def flops_per_token(seq_len: int) -> float:
            return float(6 * non_embedding + attention_flops * seq_len)

        trim = None if cfg.tied_embeddings or not cfg.can_trim else ToyDecoder.trim_to_stage
        layers = tuple(
            ("causal",)
            + (("document",) if cfg.doc_masking else ())
            + ((f"window={w}",) if (w := cfg.window_of(i)) is not None else ())
            for i in range(cfg.n_layers)
        )
        return ModelDescription(
            module=self,
            blocks=list(self.blocks.values()),
            tp_plan=self.tp_plan(),
            n_params=n_params,
            n_non_embedding_params=non_embedding,
            flops_per_token=flops_per_token,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            tied_embeddings=cfg.tied_embeddings,
            trim_to_stage=trim,
            takes_head_fn=True,
            attention=AttentionDescription(layers=layers),
        )


def sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss `Parallelized` expects: summed over the target tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class HiddenStateCrossEntropy:
    """`sum_cross_entropy` that also starts from the hidden states and the output matrix (a
    `HiddenStateLoss`), counting which form each call took."""

    def __init__(self) -> None:
        self.calls = {"logits": 0, "hidden": 0}

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls["logits"] += 1
        return sum_cross_entropy(logits, targets)

    def from_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        self.calls["hidden"] += 1
        return sum_cross_entropy(F.linear(hidden, weight), targets)


@pytest.fixture
def make_toy() -> Callable[..., ToyDecoder]:
    """`make_toy(seed=0, **config)`: a fresh ToyDecoder, the same weights for the same seed."""

    def make(seed: int = 0, **config: Any) -> ToyDecoder:
        torch.manual_seed(seed)
        return ToyDecoder(ToyConfig(**config))

    return make


@pytest.fixture
def toy_batch() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`toy_batch(batch, seq_len, seed=0)`: (tokens, targets) of a ToyDecoder's vocabulary."""

    def make(batch: int = 4, seq_len: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        window = torch.randint(0, ToyConfig().vocab_size, (batch, seq_len + 1), generator=g)
        return window[:, :-1], window[:, 1:]

    return make


@pytest.fixture
def loss_fn() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return sum_cross_entropy


@pytest.fixture
def hidden_state_loss() -> HiddenStateCrossEntropy:
    return HiddenStateCrossEntropy()


@pytest.fixture(scope="module")
def one_process_world() -> Iterator[torch.device]:
    """A process group of one (gloo, in-memory store) for the module's tests, then torn down."""
    import torch.distributed as dist

    from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed

    started = not dist.is_initialized()
    device = init_distributed(World(), "cpu")
    yield device
    if started:
        shutdown_distributed()


@pytest.fixture(scope="module")
def one_process_mesh(one_process_world) -> Any:
    """The device mesh of a world of one: every dimension (pp, dp_*, cp, tp) has size 1."""
    from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh

    return build_device_mesh(MeshSpec(), "cpu")
