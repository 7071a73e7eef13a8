"""Run under torchrun by test_parallel_layouts.py: train the tiny model 3 steps on a fixed batch
under one parallel layout and write the losses and gradient norms (rank 0) as JSON.

A layout with `"bare": true` is the reference: the same steps in plain PyTorch, one process, no
llmtrain.parallel at all. The layouts train with the trainer's loss (`cross_entropy_sum`), so
where the layout allows it the loss runs the output projection itself, in chunks
(`linear_cross_entropy`); the reference computes the whole batch's logits.
"""

import json
import sys

import torch
import torch.nn.functional as F

from llmtrain.core_mesh.config import structure
from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.parallel.options import ParallelOptions
from llmtrain.parallel.strategy import DefaultStrategy
from llmtrain.train_loop.loss import cross_entropy_sum

STEPS, BATCH, SEQ, LR, MAX_NORM = 3, 8, 32, 3e-3, 1.0


def model_config(**overrides):
    base = dict(vocab_size=320, n_layers=4, max_seq_len=64, tied_embeddings=False)
    return preset_config("tiny", **{**base, **overrides})


def batch():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 320, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def doc_starts(cfg):
    """Where documents begin in the batch's rows, for a model that masks documents (else None):
    a few per row, one at a row's first token."""
    if not cfg.doc_masking:
        return None
    starts = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(2)) < 0.15
    starts[:, 0] = starts[0, 9] = starts[1, 1] = True
    return starts


def loss_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def reference_weights(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def bare(cfg):
    model, _ = reference_weights(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    tokens, targets = batch()
    starts = doc_starts(cfg)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = loss_sum(model(tokens, starts), targets) / targets.numel()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = (loss_sum(model(tokens, starts), targets) / targets.numel()).item()
    return {"losses": losses, "grad_norms": norms, "final_loss": final}


def parallel(cfg, layout):
    world = World.from_env()
    device_type = layout.get("device", "cpu")
    device = init_distributed(world, device_type)
    spec = MeshSpec(**layout.get("mesh", {}))
    options = structure(layout.get("options", {}), ParallelOptions)
    microbatches = layout.get("microbatches", 1)
    _, weights = reference_weights(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    strategy = DefaultStrategy(options)
    strategy.check(
        spec, world.world_size, model.describe(), seq_len=SEQ, device_type=device_type,
        microbatches=microbatches,
    )  # fmt: skip
    mesh = build_device_mesh(spec, device_type)
    par = strategy.parallelize(model.describe(), mesh, device, microbatches=microbatches)
    par.materialize(lambda part: part.init_weights())
    par.load_full_state_dict(weights)
    opt = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=0.1)
    tokens, targets = batch()
    per_rank = BATCH // par.data_world
    rows = slice(par.data_rank * per_rank, (par.data_rank + 1) * per_rank)
    tokens, targets = tokens[rows].to(device), targets[rows].to(device)
    starts = doc_starts(cfg)
    starts = starts[rows].to(device) if starts is not None else None
    count = par.sum_over_data(torch.tensor(float(targets.numel()), device=device))
    trainer_loss = cross_entropy_sum(compile_chunks=options.compile)
    losses, norms = [], []
    for _ in range(STEPS):
        local = par.forward_backward(
            tokens, targets, trainer_loss, scale=1.0 / count.item(), doc_starts=starts
        )
        norms.append(par.clip_grad_norm_(MAX_NORM))
        losses.append((par.sum_over_data(local) / count).item())
        opt.step()
        opt.zero_grad()
    par.train(False)
    final = par.evaluate(tokens, targets, trainer_loss, doc_starts=starts)
    final = (par.sum_over_data(final) / count).item()
    result = {
        "losses": losses,
        "grad_norms": norms,
        "final_loss": final,
        "spec": str(par.spec),
        "loss_from_hidden": par.head_fn_ok,
    }
    shutdown_distributed()
    return world.rank, result


if __name__ == "__main__":
    out, layout = sys.argv[1], json.loads(sys.argv[2])
    cfg = model_config(**layout.get("model", {}))
    if layout.get("bare"):
        rank, result = 0, bare(cfg)
    else:
        rank, result = parallel(cfg, layout)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
