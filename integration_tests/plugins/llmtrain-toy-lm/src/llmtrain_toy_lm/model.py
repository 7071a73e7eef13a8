"""A language model that is not a transformer: token embedding, then blocks of a causal
depthwise convolution over the last `kernel` tokens and a gated MLP, each residual, then the
tied output projection. It keeps `LanguageModel`'s contract with no cache and no keyword
inputs, and training's (`init_weights`, `describe`)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.core_mesh.interfaces import ModelDescription
from llmtrain_toy_lm.options import ToyLMOptions


class MixerBlock(nn.Module):
    def __init__(self, options: ToyLMOptions):
        super().__init__()
        d, self.kernel = options.d_model, options.kernel
        self.mix_norm = nn.RMSNorm(d)
        self.mix = nn.Conv1d(d, d, options.kernel, groups=d)
        self.mlp_norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # left padding only: a token sees itself and the kernel - 1 tokens before it
        x = F.pad(self.mix_norm(h).transpose(1, 2), (self.kernel - 1, 0))
        h = h + self.mix(x).transpose(1, 2)
        gate, value = self.up(self.mlp_norm(h)).chunk(2, dim=-1)
        out: torch.Tensor = h + self.down(F.silu(gate) * value)
        return out


class ToyLM(nn.Module):
    # forward takes only the tokens: downstream scoring runs one row a request
    packed_rows: ClassVar[bool] = False

    def __init__(self, options: ToyLMOptions):
        super().__init__()
        self._options = options
        self.emb = nn.Embedding(options.vocab_size, options.d_model)
        self.blocks = nn.ModuleList(MixerBlock(options) for _ in range(options.n_layers))
        self.norm = nn.RMSNorm(options.d_model)

    @property
    def options(self) -> ToyLMOptions:
        return self._options

    def forward(self, tokens: torch.Tensor, /) -> torch.Tensor:
        if tokens.size(1) > self._options.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.size(1)} tokens is longer than the model's max_seq_len "
                f"({self._options.max_seq_len})"
            )
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.emb.weight)

    def new_cache(self, batch: int, max_len: int, /) -> None:
        """No cache: generation reruns the prefix for each new token."""
        return None

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
                nn.init.normal_(module.weight, std=self._options.init_std, generator=generator)
                if isinstance(module, nn.Conv1d) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def describe(self) -> ModelDescription:
        n_params = sum(p.numel() for p in self.parameters())
        non_embedding = n_params - self.emb.weight.numel()
        # the tied head multiplies by the embedding; the convolution is a few MACs a channel
        active = non_embedding + self.emb.weight.numel()
        return ModelDescription(
            module=self,
            blocks=list(self.blocks),
            tp_plan={},
            n_params=n_params,
            n_non_embedding_params=non_embedding,
            flops_per_token=lambda seq_len: float(6 * active),
            # no attention: no heads (n_heads / n_kv_heads left None)
            tied_embeddings=True,
        )
