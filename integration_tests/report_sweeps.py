"""Small sweeps in the layout `llmtrain sweep` writes, one per report kind, for the tests
that read reports back: packages/ablate/tests/test_report_kinds.py (what the page holds, in
which order) and integration_tests/test_report_first_screen.py (each answer on a browser's
first screen). No training: each run's config.yaml, metrics.jsonl and summary.json are
written from a known law."""

from __future__ import annotations

import json

import yaml

CHINCHILLA = (1.69, 406.4, 410.7, 0.34, 0.28)


def law(n, d):
    e, a, b, alpha, beta = CHINCHILLA
    return e + a / n**alpha + b / d**beta


def ladder_sweep(root, *, by_size=False, branches=True):
    """3 sizes x 3 tokens/param (9 rungs). By size: labels `N=..,r=..`; by budget: `C=..,r=..`.
    With branches, the two shorter rungs of each size are decay branches of its longest (their
    metrics.jsonl starts at their start step). Each run logs train loss every 10 steps and
    eval_loss once, at the end."""
    root.mkdir(parents=True)
    sizes = {16: 2e6, 32: 8e6, 64: 3.2e7}  # d_model: N
    ratios = (5, 10, 20)
    seq = 1000
    records, runs, branch_of = [], [], {}
    for width, n in sizes.items():
        trunk_id = None
        for r in sorted(ratios, reverse=True):
            d = r * n
            steps = int(d / seq)
            per_token = 6 * n * 1.1
            label = {"N": f"{n:.2g}", "r": r} if by_size else {"C": f"{per_token * d:.2g}", "r": r}
            run_id = ",".join(f"{k}={v}" for k, v in label.items())
            shape = {"d_model": width, "n_layers": 2}
            records.append(
                {"label": label, "budget": per_token * d, "tokens_per_param": float(r),
                 "target_params": n, "target_tokens": d, "params": n, "tokens": d,
                 "actual_budget": per_token * d, "actual_tokens_per_param": float(r),
                 "flops_per_token": per_token, "steps": steps, **shape}
            )  # fmt: skip
            start = 1
            if branches and trunk_id is not None:
                start = int(0.8 * steps)
                branch_of[run_id] = {"trunk": trunk_id, "start": start}
            trunk_id = trunk_id or run_id
            path = root / run_id
            path.mkdir()
            config = {"name": run_id, "model": {"kind": "tiny", **shape},
                      "training": {"steps": steps}, "data": {"tokenizer": "bytes"}}  # fmt: skip
            (path / "config.yaml").write_text(yaml.safe_dump(config))
            final = law(n, d)
            lines = [
                {"step": s, "loss": final + 3.0 / s**0.5, "tokens": s * seq}
                for s in range(max(start, 1), steps + 1, max(steps // 20, 1))
            ]
            lines.append({"step": steps, "loss": final + 0.05, "eval_loss": final, "tokens": d})
            (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            summary = {"status": "finished", "step": steps, "tokens": d, "params": n + 5e5,
                       "non_embedding_params": n, "flops_per_token": per_token}  # fmt: skip
            (path / "summary.json").write_text(json.dumps(summary))
            runs.append({"id": run_id, "settings": {"model.d_model": width}})
    manifest = {"name": root.name, "ladder": records, "runs": runs}
    if branches:
        manifest.update(branch_decays=0.2, branches=branch_of)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def transfer_sweep(root):
    """lr x width x parametrization: µP's best lr stays at 2^-7, standard's moves."""
    best = {"mup": {32: 2, 64: 2, 128: 2}, "standard": {32: 3, 64: 2, 128: 1}}
    for parametrization, widths in best.items():
        for width, at in widths.items():
            for i, lr in enumerate((2.0**-9, 2.0**-8, 2.0**-7, 2.0**-6)):
                name = f"{parametrization}-{width}-{i}"
                path = root / name
                path.mkdir(parents=True)
                config = {"name": name, "optimizer": {"lr": lr},
                          "model": {"d_model": width, "parametrization": parametrization}}  # fmt: skip
                (path / "config.yaml").write_text(yaml.safe_dump(config))
                loss = 2.0 + 0.1 * abs(i - at)
                lines = [{"step": s, "loss": loss + 1.0 / s, "tokens": 100 * s} for s in (1, 2, 3)]
                lines[-1]["eval_loss"] = loss
                (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
                (path / "summary.json").write_text(
                    json.dumps({"status": "finished", "tokens": 300})
                )
    return root


def ablation_sweep(root):
    """lr 1e-3 vs 3e-3, two seeds each: 3e-3 is 0.2 lower in final eval_loss."""
    for lr in (1e-3, 3e-3):
        for seed in (0, 1):
            path = root / f"lr={lr:g},seed={seed}"
            path.mkdir(parents=True)
            config = {"seed": seed, "optimizer": {"lr": lr}}
            (path / "config.yaml").write_text(yaml.safe_dump(config))
            lines = [{"step": 1, "loss": 3.0, "eval_loss": 3.1}, {"step": 2, "loss": 2.5,
                     "eval_loss": 2.6 - (lr > 2e-3) * 0.2 + (0.01 + lr) * seed}]  # fmt: skip
            (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            (path / "summary.json").write_text(json.dumps({"status": "finished", "tokens": 200}))
    return root
