"""Run under torchrun by test_parallel_layouts.py (and test_gpu.py): for each of several named
parallel layouts in turn, train the tiny model 3 steps on a fixed batch and write the losses and
gradient norms (rank 0) as JSON, {name: result}.

The layouts of one world size share one torchrun: the process group starts once and every
layout builds its own device mesh over it, so the cases pay for one start of the processes, not
one each. Rank 0 rewrites the file after every case; a case that raises writes its traceback
under its name and ends the run (its peers may be waiting in a collective), leaving the cases
after it without a result.

`bare(cfg)` is the reference: the same steps in plain PyTorch, one process, no
llmtrain.parallel at all. The layouts train with the trainer's loss (`cross_entropy_sum`), so
where the layout allows it the loss runs the output projection itself, in chunks
(`linear_cross_entropy`); the reference computes the whole batch's logits.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from llmtrain.core_mesh.config import structure
from llmtrain.core_mesh.mesh import MeshSpec, build_device_mesh
from llmtrain.core_mesh.world import World, init_distributed, shutdown_distributed
from llmtrain.models.config import AttentionOptions
from llmtrain.models.presets import preset_config
from llmtrain.models.transformer import build_model
from llmtrain.parallel.options import ParallelOptions
from llmtrain.parallel.strategy import DefaultStrategy
from llmtrain.train_loop.loss import cross_entropy_sum

STEPS, BATCH, SEQ, LR, MAX_NORM = 3, 8, 32, 3e-3, 1.0


def model_config(**overrides):
    base = dict(vocab_size=320, n_layers=4, max_seq_len=64, tied_embeddings=False)
    if "attention" in overrides:  # a section of its own, as `model.attention` in a run config
        overrides["attention"] = structure(overrides["attention"], AttentionOptions)
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


def parallel(cfg, layout, world: World, device: torch.device) -> dict:
    device_type = device.type
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
        norms.append(par.clip_grad_norm_(MAX_NORM).item())
        losses.append((par.sum_over_data(local) / count).item())
        opt.step()
        opt.zero_grad()
    par.train(False)
    final = par.evaluate(tokens, targets, trainer_loss, doc_starts=starts)
    final = (par.sum_over_data(final) / count).item()
    return {
        "losses": losses,
        "grad_norms": norms,
        "final_loss": final,
        "spec": str(par.spec),
        "loss_from_hidden": par.head_fn_ok,
    }


def run_cases(out: Path, cases: dict[str, dict]) -> None:
    """Every case in order on one process group (the device of the cases' `device`, default
    cpu); rank 0 writes {name: result} after each."""
    (device_type,) = {layout.get("device", "cpu") for layout in cases.values()}
    world = World.from_env()
    device = init_distributed(world, device_type)
    results: dict[str, dict] = {}
    for name, layout in cases.items():
        try:
            results[name] = parallel(model_config(**layout.get("model", {})), layout, world, device)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            raise
        finally:
            if world.rank == 0:
                out.write_text(json.dumps(results))
    shutdown_distributed()


if __name__ == "__main__":
    run_cases(Path(sys.argv[1]), json.loads(sys.argv[2]))
