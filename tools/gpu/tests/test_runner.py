"""The GPU kit's dry run on CPU (tools/gpu/runner.py --dry-run): every step's command parses
and starts here, so the first GPU session does not die on a typo; a failing step is reported
with its tail and costs the steps after it nothing."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

KIT = Path(__file__).resolve().parents[1]
RUNNER = KIT / "runner.py"
STEPS = [
    "install", "data", "gpu-tests", "bench-model", "bench-parallel", "gpt2-run", "gpt2-syncs",
    "float8-run", "moe-run", "moe-olmoe", "dense-olmoe-active", "moe-ep2", "deterministic",
    "torchtitan-b4", "llama-b4", "llama-b4-docmask", "llama-b4-float8", "llama-b4-syncs",
    "torchtitan-b8", "llama-b8", "llama-causal-8k", "llama-window-8k", "llama-cp2-8k",
    "llama-cp2-docmask", "bare-loop", "profile-b4",
]  # fmt: skip
LONG = ("llama-causal-8k", "llama-window-8k", "llama-cp2-8k", "llama-cp2-docmask")
TORCHTITAN = ("torchtitan-b4", "torchtitan-b8")


def dry_run(tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    """No wheels in the bundle folder: the runner builds the repo's wheels offline and
    installs those."""
    out = tmp_path / "out"
    command = [sys.executable, str(RUNNER), "--dry-run", "--bundle", str(tmp_path / "no-bundle")]
    command += ["--out", str(out), "--work", str(tmp_path / "work"), *args]
    env = {**os.environ, **(env or {})}
    subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert (out / "report.md").is_file()
    return json.loads((out / "report.json").read_text())


def torchtitan_folder(folder: Path) -> Path:
    """What bundle.sh puts in .gpu-bundle/torchtitan/, as placeholders: the wheels named as
    torchtitan_wheels.txt pins them (CI has no package index and no ../shared anchor)."""
    for name in ("run_tt.sh", "llama3_1b.toml", "tt_llama1b.py", "cpu_smoke_train.py",
                 "data/corpus.jsonl.gz", "assets/tokenizer/tokenizer.json",
                 "assets/tokenizer/tokenizer_config.json"):  # fmt: skip
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("placeholder")
    for line in (KIT / "torchtitan_wheels.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            where, _, pin = line.rpartition("/")
            name, _, version = pin.partition("==")
            wheel = folder / "wheels" / where / f"{name}-{version}-py3-none-any.whl"
            wheel.parent.mkdir(parents=True, exist_ok=True)
            wheel.write_text("placeholder")
    return folder


@pytest.mark.slow
def test_dry_run_passes_every_step(tmp_path):
    report = dry_run(tmp_path)
    assert report["mode"] == "dry-run"
    assert [s["name"] for s in report["steps"]] == STEPS
    steps = {s["name"]: s for s in report["steps"]}
    status = {name: (s["status"], s["tail"][-2000:]) for name, s in steps.items()}
    assert all(status[n][0] == "passed" for n in STEPS if n not in TORCHTITAN), status
    runs = {s["name"]: s["figures"] for s in report["steps"]}
    assert runs["gpt2-run"]["tokens_per_s"] > 0 and runs["bare-loop"]["tokens_per_s"] > 0
    for name in ("llama-b4", "llama-b4-docmask", "llama-b4-syncs", "llama-b8", "gpt2-syncs"):
        assert runs[name]["steady_tokens_per_s"] > 0, name
    # the MoE pair on CPU (olmoe-tiny and its dense twin, an MFU against a nominal peak): the
    # ratio of their MFUs, with the FLOPs each counts (the tiny MoE's routers are 1.8% of them)
    moe, dense = runs["moe-olmoe"], runs["dense-olmoe-active"]
    assert moe["flops_per_token"] == pytest.approx(dense["flops_per_token"], rel=0.02)
    assert (
        runs["moe-ep2"]["mfu"] > 0 and runs["moe-ep2"]["flops_per_token"] == moe["flops_per_token"]
    )
    versus = report["side_by_side"]["moe_vs_dense"]
    # the report rounds ratios to 4 decimals (CPU contention can make this one small)
    assert versus["ratio"] == pytest.approx(moe["mfu"] / dense["mfu"], abs=5e-5)
    assert versus["goal"] == 0.6 and versus["met"] == (versus["ratio"] >= 0.6)
    assert (
        "MoE MFU / dense MFU (moe-olmoe / dense-olmoe-active)"
        in (tmp_path / "out" / "report.md").read_text()
    )
    # the profile's table comes back in the step's log (the CPU trace: operators by self time)
    profiled = (tmp_path / "out" / "profile-b4" / "profile-b4.log").read_text()
    assert "operators by self time" in profiled and "aten::mm" in profiled
    # no bundle here: TorchTitan is not started (its CPU run takes ~1.5 min; by hand, README);
    # its GPU form is checked by test_the_side_by_side_steps_as_the_gpu_gets_them
    for name in TORCHTITAN:
        assert steps[name]["status"] == "skipped" and "gpu-bundle" in steps[name]["reason"]
        assert "cpu_smoke_train.py" in steps[name]["commands"][-1]
    # the one table: our rows measured (CPU figures), TorchTitan's "not run" with the reason
    table = {r["step"]: r for r in report["side_by_side"]["torchtitan"]["rows"]}
    assert table["llama-b4"]["status"] == "measured"
    assert table["llama-b4-docmask"]["ratio"] > 0
    # the host reads as before (debug.host_syncs), against the same run without them; gpt2's
    # rows have no MFU counted with llama's FLOPs per token
    assert (
        table["llama-b4-syncs"]["reference"] == "llama-b4" and table["llama-b4-syncs"]["ratio"] > 0
    )
    assert table["gpt2-syncs"]["reference"] == "gpt2-run" and table["gpt2-syncs"]["ratio"] > 0
    assert "mfu_counted" not in table["gpt2-run"] and "mfu_counted" not in table["gpt2-syncs"]
    assert table["torchtitan-b4"]["status"].startswith("not run: torchtitan-b4 skipped")
    goals = {g["goal"]: g["status"] for g in report["side_by_side"]["torchtitan"]["goals"]}
    assert goals["b4: llmtrain tokens/s >= 1.0x TorchTitan's"] == "not run"
    assert "| llmtrain b4 | llama-b4 |" in (tmp_path / "out" / "report.md").read_text()
    # long context: the tiny model at seq 32, window 8 against causal on one process, cp=2 with
    # and without doc masking in two; a local block's FLOPs count 8 keys a query, not 32
    for name in LONG:
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["mfu"] > 0, name
    causal, window = runs["llama-causal-8k"], runs["llama-window-8k"]
    assert causal["flops_per_token"] - window["flops_per_token"] == 12 * 2 * 64 * (32 - 8)
    pairs = {p["step"]: p for p in report["side_by_side"]["long_context"]}
    assert pairs["llama-window-8k"]["ratio"] == pytest.approx(
        window["tokens_per_s"] / causal["tokens_per_s"], abs=5e-5
    )
    assert pairs["llama-cp2-docmask"]["reference"] == "llama-cp2-8k"
    assert pairs["llama-cp2-docmask"]["ratio"] > 0
    assert (
        "| window 1024 / full causal (seq 8192, one GPU) |"
        in (tmp_path / "out" / "report.md").read_text()
    )


@pytest.mark.slow
def test_a_failing_step_is_reported_and_the_next_steps_run(tmp_path):
    # a bundle with a torchtitan/ folder but no wheels of ours (those are built here), and a
    # Python for TorchTitan that lacks what it needs: its files are checked, it is not started
    torchtitan_folder(tmp_path / "no-bundle" / "torchtitan")
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # no site-packages
    bare.chmod(0o755)
    report = dry_run(
        tmp_path, "--only", "gpu-tests,float8-run,torchtitan-b4", "--break", "gpu-tests",
        env={"TT_PYTHON": str(bare)},
    )  # fmt: skip
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["install", "data", "gpu-tests", "float8-run", "torchtitan-b4"]
    assert steps["gpu-tests"]["status"] == "failed"
    assert "gpu-tests made to fail by --break" in steps["gpu-tests"]["tail"]
    assert steps["float8-run"]["status"] == "passed", steps["float8-run"]["tail"]
    titan = steps["torchtitan-b4"]
    assert titan["status"] == "skipped", titan
    assert titan["reason"].startswith("files checked; TorchTitan not started"), titan["reason"]
    assert "lacks pip, torch, triton" in titan["reason"]


def test_the_torchtitan_folder_check_names_what_is_missing(tmp_path):
    folder = torchtitan_folder(tmp_path / "torchtitan")
    check = [sys.executable, str(KIT / "side_by_side.py"), "check-torchtitan", str(folder)]
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    (folder / "assets" / "tokenizer" / "tokenizer.json").unlink()
    (folder / "wheels" / "multiprocess-0.70.18-py3-none-any.whl").unlink()
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 1
    assert "assets/tokenizer/tokenizer.json is missing" in done.stdout
    assert "wheels/multiprocess==0.70.18 is missing" in done.stdout


def test_the_side_by_side_steps_as_the_gpu_gets_them(tmp_path, monkeypatch):
    """The GPU form of the side-by-side's steps, which no CPU run starts: TorchTitan tied at
    batch 4 and 8 from the bundle, our runs at the same shape with their options."""
    monkeypatch.syspath_prepend(str(KIT))
    steps = importlib.import_module("steps")  # tools/gpu/steps.py
    bundle = tmp_path / "bundle"
    torchtitan_folder(bundle / "torchtitan")
    ctx = steps.Context(
        KIT.parents[1], tmp_path / "work", "python3", False, tmp_path / "out", bundle
    )
    ctx.configs.mkdir(parents=True)
    plan = {s.name: s for s in steps.plan(ctx, ["true"], str(bundle))}
    for batch in (4, 8):
        titan = plan[f"torchtitan-b{batch}"]
        assert not titan.skip and not titan.checks_only
        check, run = (" ".join(map(str, c)) for c in titan.commands)
        assert check.endswith(f"side_by_side.py check-torchtitan {bundle / 'torchtitan'}")
        assert "TT_TIE=1" in run and f"OUT={tmp_path / 'out' / titan.name}" in run
        assert "TT_ENTRY" not in run and "tools/gpu/torchtitan.sh" in run
        assert run.endswith(
            f"--training.local_batch_size {batch} --training.seq_len 2048 --training.steps 40"
        )
    configs = {}
    for name in ("llama-b4", "llama-b8", "llama-b4-docmask", "llama-b4-float8", "llama-b4-syncs"):
        (command,) = plan[name].commands
        assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in command
        configs[name] = yaml.safe_load(Path(command[-1]).read_text())
        assert configs[name]["training"] == {"steps": 40, "log_every": 10}
        assert configs[name]["parallel"]["compile"] is True
    assert [configs[n]["data"]["micro_batch"] for n in ("llama-b4", "llama-b8")] == [4, 8]
    assert configs["llama-b4-docmask"]["model"]["doc_masking"] is True
    assert configs["llama-b4-float8"]["parallel"]["float8"] is True
    assert "doc_masking" not in configs["llama-b4"]["model"]
    # llama-b4 as it was, with the host reads a step made before issue 47 put back
    assert configs["llama-b4-syncs"]["debug"] == {"host_syncs": True}
    assert {k: v for k, v in configs["llama-b4-syncs"].items() if k not in ("name", "debug")} == {
        k: v for k, v in configs["llama-b4"].items() if k != "name"
    }
    gpt2, gpt2_syncs = (
        yaml.safe_load(Path(plan[n].commands[0][-1]).read_text())
        for n in ("gpt2-run", "gpt2-syncs")
    )
    assert gpt2_syncs["debug"] == {"host_syncs": True} and "debug" not in gpt2
    assert gpt2_syncs["model"] == gpt2["model"] == {"kind": "gpt2-124m", "max_seq_len": 1024}
    # the profile step: TorchTitan b4 with its profiler on, then our b4 with ours, at step 20
    titan_run, titan_profile, ours_run, ours_profile = map(
        " ".join, plan["profile-b4"].commands[1:]
    )
    assert "--training.local_batch_size 4" in titan_run
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in ours_run
    assert titan_run.endswith("--profiling.enable_profiling --profiling.profile_freq 20 "
                              "--profiling.profiler_active 1")  # fmt: skip
    assert "torchtitan-profile-b4/out/profile_traces/iteration_*/rank0_trace.json" in titan_profile
    profiled = yaml.safe_load(Path(plan["profile-b4"].commands[3][-1]).read_text())
    assert profiled["profile"] == {"every": 20, "active": 1, "warmup": 1}
    assert (
        profiled["data"]["micro_batch"] == 4 and profiled["model"] == configs["llama-b4"]["model"]
    )
    assert ours_profile.endswith(f"llmtrain profile --top 25 {ctx.runs / 'profile-b4'}")


def gpu_plan(tmp_path: Path, gpus: int) -> dict:
    """The kit's steps as a GPU machine with `gpus` devices gets them (no CPU run starts)."""
    sys.path.insert(0, str(KIT))
    try:
        steps = importlib.import_module("steps")  # tools/gpu/steps.py
    finally:
        sys.path.remove(str(KIT))
    ctx = steps.Context(
        KIT.parents[1], tmp_path / "work", "python3", False, tmp_path / "out", None, gpus
    )
    ctx.configs.mkdir(parents=True, exist_ok=True)
    return {s.name: s for s in steps.plan(ctx, ["true"], "bundle")}


def test_the_moe_steps_as_the_gpu_gets_them(tmp_path):
    """olmoe-1b-7b at 4 layers and its dense twin: compiled, bf16, one process, the same shape;
    their active FLOPs per token equal (the meta models' `describe()`); EP=2 under torchrun
    where there are 2 GPUs, skipped saying why where there is one."""
    import torch

    from llmtrain.core_mesh.config import structure
    from llmtrain.core_mesh.plugins import MODEL, PluginManager
    from llmtrain.train_loop.run_config import RunConfig

    plan = gpu_plan(tmp_path, gpus=1)
    configs = {}
    for name in ("moe-olmoe", "dense-olmoe-active"):
        (command,) = plan[name].commands
        assert (
            command[-2:-1] == ["run"] and "PYTORCH_ALLOC_CONF=expandable_segments:True" in command
        )
        configs[name] = yaml.safe_load(Path(command[-1]).read_text())
        assert configs[name]["parallel"] == {
            "kind": "default", "compile": True, "param_dtype": "bfloat16"
        }  # fmt: skip
        assert "mesh" not in configs[name] and configs[name]["training"]["steps"] == 40
    moe = configs["moe-olmoe"]["model"]
    assert moe == {"kind": "olmoe-1b-7b", "n_layers": 4, "expert_matmul": "grouped",
                   "max_seq_len": 2048}  # fmt: skip
    assert configs["moe-olmoe"]["data"] == configs["dense-olmoe-active"]["data"]
    plugins = PluginManager().load_entry_points()
    flops, shapes = {}, {}
    for name, config in configs.items():
        config["data"]["train"] = [{"path": "unused.zarr"}]
        options = structure(config, RunConfig, plugins=plugins)
        with torch.device("meta"):
            described = plugins.build(MODEL, options.model).describe()
        flops[name] = described.flops_per_token(2048)
        shapes[name] = plugins.options_of("model", options.model)
    m, d = shapes["moe-olmoe"], shapes["dense-olmoe-active"]
    assert (m.d_model, m.n_layers, m.n_heads, m.vocab_size) == (2048, 4, 16, 50304)
    assert (d.d_model, d.n_layers, d.n_heads, d.vocab_size) == (2048, 4, 16, 50304)
    assert d.mlp_hidden == m.top_k * m.mlp_hidden == 8192 and m.n_experts == 64
    # 6 x active parameters + attention: equal but for the routers (4 x 2048 x 64 x 6)
    assert flops["moe-olmoe"] - flops["dense-olmoe-active"] == 6 * 4 * 2048 * 64
    assert plan["moe-ep2"].skip == "expert parallelism needs 2 GPUs; this machine has 1"
    (command,) = gpu_plan(tmp_path, gpus=2)["moe-ep2"].commands
    assert "torch.distributed.run --standalone --nproc-per-node=2 -m llmtrain run" in " ".join(
        command
    )
    ep = yaml.safe_load(Path(command[-1]).read_text())
    assert ep["mesh"] == {"dp_shard": 2, "ep": 2} and ep["model"] == moe


def test_the_long_context_steps_as_the_gpu_gets_them(tmp_path):
    """llama-1b at seq 8192 x 2, bf16 + compile: every block local (window 1024) against full
    causal in one process; cp=2 with doc masking against without under torchrun where there
    are 2 GPUs, skipped saying why where there is one. Each pair differs in that alone."""
    plan = gpu_plan(tmp_path, gpus=1)
    configs = {}
    for name in ("llama-causal-8k", "llama-window-8k"):
        (command,) = plan[name].commands
        assert command[-2] == "run" and "PYTORCH_ALLOC_CONF=expandable_segments:True" in command
        configs[name] = yaml.safe_load(Path(command[-1]).read_text())
    causal, window = configs["llama-causal-8k"], configs["llama-window-8k"]
    assert causal["model"] == {"kind": "llama-1b", "max_seq_len": 8192}
    assert (causal["data"]["seq_len"], causal["data"]["micro_batch"]) == (8192, 2)
    assert causal["training"] == {"steps": 40, "log_every": 10} and "mesh" not in causal
    assert causal["parallel"] == {"kind": "default", "compile": True, "param_dtype": "bfloat16"}
    assert window["model"] == {**causal["model"], "attention": {"window": 1024}}
    assert {k: v for k, v in window.items() if k not in ("name", "model")} == {
        k: v for k, v in causal.items() if k not in ("name", "model")
    }
    # the FLOPs each run's MFU is on (the meta model's `describe()`): a local block counts
    # 1,024 keys a query where a causal one counts 8,192
    import torch

    from llmtrain.core_mesh.config import structure
    from llmtrain.core_mesh.plugins import MODEL, PluginManager
    from llmtrain.train_loop.run_config import RunConfig

    plugins, flops = PluginManager().load_entry_points(), {}
    for name, config in configs.items():
        options = structure({**config, "data": {**config["data"], "train": [{"path": "x.zarr"}]}},
                            RunConfig, plugins=plugins)  # fmt: skip
        with torch.device("meta"):
            flops[name] = plugins.build(MODEL, options.model).describe().flops_per_token(8192)
    assert flops["llama-causal-8k"] - flops["llama-window-8k"] == 12 * 16 * 2048 * (8192 - 1024)
    for name in ("llama-cp2-8k", "llama-cp2-docmask"):
        assert plan[name].skip == "context parallelism over 2 GPUs; this machine has 1"
    plan = gpu_plan(tmp_path, gpus=2)
    cp = {}
    for name in ("llama-cp2-8k", "llama-cp2-docmask"):
        assert not plan[name].skip
        (command,) = plan[name].commands
        assert "torch.distributed.run --standalone --nproc-per-node=2 -m llmtrain run" in " ".join(
            map(str, command)
        )
        cp[name] = yaml.safe_load(Path(command[-1]).read_text())
        assert cp[name]["mesh"] == {"cp": 2}
        assert {k: v for k, v in cp[name].items() if k not in ("name", "mesh", "model")} == {
            k: v for k, v in causal.items() if k not in ("name", "model")
        }
    assert cp["llama-cp2-8k"]["model"] == causal["model"]
    assert cp["llama-cp2-docmask"]["model"] == {**causal["model"], "doc_masking": True}


def test_long_context_ratios_in_a_merged_report(tmp_path):
    """Window against causal and CP doc masking against CP causal: the ratios of tokens/s and
    MFU, with both runs' FLOPs per token; a pair whose run did not pass says why."""

    def step(name, tokens_per_s, mfu, flops, status="passed", reason=""):
        figures = (
            {
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "flops_per_token": flops,
                "peak_gib": 60.0,
                "reserved_gib": 62.0,
            }
            if status == "passed"
            else {}
        )
        return {"name": name, "status": status, "reason": reason, "seconds": 1.0, "measures": "",
                "commands": [], "tail": "", "budget_s": 1, "figures": figures}  # fmt: skip

    report = tmp_path / "call.json"
    steps = [
        step("llama-causal-8k", 40000.0, 0.43, 1.0237e10),
        step("llama-window-8k", 50000.0, 0.40, 7.8e9),
        step("llama-cp2-8k", 0, 0, 0, "skipped", "context parallelism over 2 GPUs; ..."),
    ]
    report.write_text(json.dumps({"mode": "gpu", "environment": {}, "steps": steps}))
    out = tmp_path / "merged"
    command = [sys.executable, str(RUNNER), "--merge", str(report), "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    window, cp = json.loads((out / "report.json").read_text())["side_by_side"]["long_context"]
    assert window["ratio"] == 1.25 and window["mfu_ratio"] == pytest.approx(0.4 / 0.43, abs=1e-4)
    assert window["step_flops_per_token"] == 7.8e9
    assert window["reference_flops_per_token"] == 1.0237e10
    assert cp["ratio"] is None and cp["note"] == (
        "llama-cp2-docmask not run; llama-cp2-8k skipped (context parallelism over 2 GPUs; ...)"
    )
    text = (out / "report.md").read_text()
    assert (
        "| window 1024 / full causal (seq 8192, one GPU) | 1.250 | 0.930 | "
        "llama-window-8k | 50,000 | 40.0% | 7.8e+09 | 60.0 (62.0) |"
    ) in text
    assert "| | | | llama-causal-8k | 40,000 | 43.0% | 1.024e+10 | 60.0 (62.0) |" in text


def test_moe_against_dense_in_a_merged_report(tmp_path):
    """The ratio of the MoE's MFU to the dense model's, against the goal, from figures."""

    def step(name, mfu, flops):
        return {"name": name, "status": "passed", "reason": "", "seconds": 1.0, "measures": "",
                "commands": [], "tail": "", "budget_s": 1,
                "figures": {"tokens_per_s": 1000.0, "mfu": mfu, "flops_per_token": flops}}  # fmt: skip

    report = tmp_path / "call.json"
    steps = [step("moe-olmoe", 0.21, 2.4334e9), step("dense-olmoe-active", 0.42, 2.4303e9)]
    report.write_text(json.dumps({"mode": "gpu", "environment": {}, "steps": steps}))
    out = tmp_path / "merged"
    command = [sys.executable, str(RUNNER), "--merge", str(report), "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    versus = json.loads((out / "report.json").read_text())["side_by_side"]["moe_vs_dense"]
    assert versus["ratio"] == 0.5 and versus["met"] is False and versus["goal"] == 0.6
    assert versus["moe_flops_per_token"] == 2.4334e9
    report.write_text(json.dumps({"mode": "gpu", "environment": {}, "steps": steps[:1]}))
    subprocess.run(command, check=True, capture_output=True)
    versus = json.loads((out / "report.json").read_text())["side_by_side"]["moe_vs_dense"]
    assert versus == {"ratio": None, "goal": 0.6, "note": "dense-olmoe-active not run"}


def test_two_calls_merge_into_one_table_with_goals(tmp_path):
    """The side-by-side takes two device calls; --merge makes one report of them. Figures as
    the first GPU session measured them (issue 35): every goal fails, the b8 float8 ratio is
    across calls, and a row no call ran is "not run"."""

    def step(name, call_figures, status="passed", reason=""):
        return {"name": name, "status": status, "reason": reason, "figures": call_figures,
                "seconds": 1.0, "measures": "", "commands": [], "tail": "", "budget_s": 1}  # fmt: skip

    def ours(tokens_per_s, mfu, reserved, allocated):
        return {"tokens_per_s": tokens_per_s, "steady_tokens_per_s": tokens_per_s,
                "steady_mfu": mfu, "reserved_gib": reserved, "peak_gib": allocated}  # fmt: skip

    environment = {"gpu": "NVIDIA H100 80GB HBM3"}
    titan = {"tokens_per_s": 56518, "mfu": 0.47, "peak_reserved_gib": 30.0, "peak_flops": 9.89e14}
    first = [
        step("torchtitan-b4", titan),
        step("llama-b4", ours(52656, 0.354, 38.9, 37.8)),
        step("llama-b4-docmask", ours(46447, 0.312, 39.5, 38.3)),
    ]
    second = [
        step("torchtitan-b8", {**titan, "tokens_per_s": 61901, "peak_reserved_gib": 43.9}),
        step("llama-b8", {}, "timeout", "over its budget of 270 s"),
        step("llama-b4-float8", ours(56167, 0.38, 34.0, 33.0)),
    ]
    reports = []
    for i, steps in enumerate((first, second)):
        reports.append(tmp_path / f"call{i}.json")
        reports[-1].write_text(
            json.dumps({"mode": "gpu", "environment": environment, "steps": steps})
        )
    out = tmp_path / "merged"
    command = [sys.executable, str(RUNNER), "--merge", *map(str, reports), "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    doc = json.loads((out / "report.json").read_text())["side_by_side"]["torchtitan"]
    rows = {r["step"]: r for r in doc["rows"]}
    assert rows["llama-b4"]["ratio"] == pytest.approx(52656 / 56518)
    assert "across_calls" not in rows["llama-b4"]
    assert rows["llama-b4-docmask"]["ratio"] == pytest.approx(46447 / 52656)
    assert rows["llama-b4-float8"]["across_calls"] is True
    assert rows["llama-b8"]["status"] == "not run: llama-b8 timeout (over its budget of 270 s)"
    assert rows["llama-b4"]["mfu_counted"] == pytest.approx(52656 * 8.2202e9 / 9.89e14, rel=1e-4)
    goals = {g["goal"]: g for g in doc["goals"]}
    assert [g["status"] for g in goals.values()] == [
        "fail",
        "fail",
        "not run",
        "not run",
        "fail",
        "fail",
    ]
    assert goals["b8: llmtrain tokens/s >= 1.0x TorchTitan's"]["reason"].startswith(
        "not run: llama-b8"
    )
    report = (out / "report.md").read_text()
    assert (
        "| llmtrain b4 | llama-b4 | 52,656 | 35.4% | 43.8% | 38.9 (37.8) | 0.932 of torchtitan-b4 |"
        in report
    )
    assert "0.994 of torchtitan-b4 (another call)" in report
