"""Run under torchrun (gloo, CPU) by test_context_parallel_ranks.py: for each named case in turn,
conftest's toy decoder trains 3 AdamW steps on a fixed batch over a cp=2 mesh, and rank 0 writes
the losses, gradient norms and the loss after them, beside those of the same steps in one plain
process without llmtrain.parallel, as JSON {name: {"parallel": ..., "plain": ...}}.

A case may set the toy's `model` options (doc_masking, window), the strategy's `options` and
`microbatches`. Rank 0 rewrites the file after every case; a case that raises writes its
traceback under its name and ends the run.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from conftest import ToyConfig, ToyDecoder, sum_cross_entropy

from llmtrain.core_mesh.config import structure
from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed
from llmtrain.parallel.options import ParallelOptions
from llmtrain.parallel.strategy import DefaultStrategy

STEPS, BATCH, SEQ, LR, MAX_NORM = 3, 4, 16, 3e-3, 1.0


def batch(cfg: ToyConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    starts = None
    if cfg.doc_masking:
        starts = torch.rand(BATCH, SEQ, generator=g) < 0.2
        starts[:, 0] = starts[0, 5] = starts[1, 9] = starts[2, 3] = True
    return data[:, :-1], data[:, 1:], starts


def weights(cfg: ToyConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in ToyDecoder(cfg).state_dict().items()}


def plain(cfg: ToyConfig) -> dict:
    model = ToyDecoder(cfg)
    model.load_state_dict(weights(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    tokens, targets, starts = batch(cfg)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = sum_cross_entropy(model(tokens, starts), targets) / targets.numel()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = (sum_cross_entropy(model(tokens, starts), targets) / targets.numel()).item()
    return {"losses": losses, "grad_norms": norms, "final_loss": final}


def parallel(cfg: ToyConfig, case: dict, world: World) -> dict:
    options = structure(case.get("options", {}), ParallelOptions)
    microbatches = case.get("microbatches", 1)
    strategy = DefaultStrategy(options)
    with torch.device("meta"):
        model = ToyDecoder(cfg)
    spec = strategy.check(
        MeshSpec(cp=2), world.world_size, model.describe(), seq_len=SEQ, device_type="cpu",
        microbatches=microbatches,
    )  # fmt: skip
    par = strategy.parallelize(
        model.describe(), build_device_mesh(spec, "cpu"), torch.device("cpu"),
        microbatches=microbatches,
    )  # fmt: skip
    par.materialize(lambda part: None)
    par.load_full_state_dict(weights(cfg))
    opt = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=0.1)
    tokens, targets, starts = batch(cfg)
    count = targets.numel()
    losses, norms = [], []
    for _ in range(STEPS):
        total = par.forward_backward(
            tokens, targets, sum_cross_entropy, scale=1.0 / count, doc_starts=starts
        )
        norms.append(par.clip_grad_norm_(MAX_NORM).item())
        losses.append(total.item() / count)
        opt.step()
        opt.zero_grad()
    par.train(False)
    final = par.evaluate(tokens, targets, sum_cross_entropy, doc_starts=starts).item() / count
    return {"losses": losses, "grad_norms": norms, "final_loss": final, "spec": str(par.spec)}


def run_cases(out: Path, cases: dict[str, dict]) -> None:
    torch.set_num_threads(1)
    world = World.from_env()
    init_distributed(world, "cpu")
    results: dict[str, dict] = {}
    for name, case in cases.items():
        cfg = ToyConfig(**case.get("model", {}))
        try:
            results[name] = {"parallel": parallel(cfg, case, world)}
            if world.rank == 0:
                results[name]["plain"] = plain(cfg)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            raise
        finally:
            if world.rank == 0:
                out.write_text(json.dumps(results))
    shutdown_distributed()


if __name__ == "__main__":
    run_cases(Path(sys.argv[1]), json.loads(sys.argv[2]))
