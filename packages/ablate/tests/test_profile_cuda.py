"""`llmtrain profile` on a CUDA trace: the GPU time of the kernels, copies and sets each host
operator launched, and the top kernels, on a hand-made trace in the layout torch.profiler
writes (kineto's ChromeTraceLogger):

- host events on the process's pid and the thread's tid: `cpu_op` and `user_annotation`
  (`ProfilerStep#N` among them) with `args["External id"]`, and the launches, `cuda_runtime`
  (`cudaLaunchKernel`, `cudaMemcpyAsync`, ...) or `cuda_driver` (`cuLaunchKernelEx`, what Triton
  calls), with `args` {"External id", "cbid", "correlation"};
- GPU activities on pid = the device and tid = the stream: `kernel`, `gpu_memcpy` and
  `gpu_memset`, with `args` {"External id" (the launching operator's), "device", "stream",
  "correlation", ...}, and the `gpu_user_annotation` span of the step, which is not GPU work;
- one "ac2g" flow per launch: "ph": "s" at the launch on its thread, "ph": "f" with "bp": "e"
  at the activity on its stream, `id` = the correlation id;
- `cuda_sync` events and synchronising runtime calls, which launch nothing.

Durations are multiples of 1/4 us, so every sum below is exact.
"""

from __future__ import annotations

import copy
import json
import re

from llmtrain.ablate import reports

PID, HOST, BACKWARD = 4242, 4242, 4300  # the process, its main thread, autograd's thread
DEVICE, STREAM, NCCL_STREAM = 0, 7, 13


def op(name, ts, dur, ext, *, tid=HOST, cat="cpu_op"):
    args = {"External id": ext, "Record function id": 0, "Ev Idx": ext - 1}
    return [{"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
             "args": args}]  # fmt: skip


def launch(name, ts, dur, correlation, ext, *, tid=HOST, cat="cuda_runtime", cbid=211):
    """A runtime (or driver) call that enqueues GPU work, and the start of its flow arrow."""
    return [
        {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
         "args": {"External id": ext, "cbid": cbid, "correlation": correlation}},
        {"ph": "s", "id": correlation, "pid": PID, "tid": tid, "ts": ts, "cat": "ac2g",
         "name": "ac2g"},
    ]  # fmt: skip


def on_gpu(name, ts, dur, correlation, ext, *, cat="kernel", stream=STREAM, flow=True):
    """A kernel, copy or set on a stream, and the end of its flow arrow."""
    if cat == "kernel":
        args = {"External id": ext, "queued": 0, "device": DEVICE, "context": 1,
                "stream": stream, "correlation": correlation, "registers per thread": 168,
                "shared memory": 232448, "blocks per SM": 0.984848, "warps per SM": 11.818182,
                "grid": [130, 1, 1], "block": [384, 1, 1], "est. achieved occupancy %": 0}  # fmt: skip
    else:
        args = {"External id": ext, "device": DEVICE, "context": 1, "stream": stream,
                "correlation": correlation, "bytes": 4096, "memory bandwidth (GB/s)": 0.33}  # fmt: skip
    events = [{"ph": "X", "cat": cat, "name": name, "pid": DEVICE, "tid": stream, "ts": ts,
               "dur": dur, "args": args}]  # fmt: skip
    if flow:
        events.append({"ph": "f", "id": correlation, "pid": DEVICE, "tid": stream, "ts": ts,
                       "cat": "ac2g", "name": "ac2g", "bp": "e"})  # fmt: skip
    return events


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas"
TRITON = "triton_poi_fused_mul_0"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
MEMCPY = "Memcpy HtoD (Pageable -> Device)"
MEMSET = "Memset (Device)"
BACKWARD_OP = "autograd::engine::evaluate_function: MmBackward0"


def cuda_trace() -> dict:
    events = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": 0,
         "args": {"name": "python3"}},
        {"name": "process_name", "ph": "M", "ts": 0, "pid": DEVICE, "tid": 0,
         "args": {"name": "python3"}},
        {"name": "process_labels", "ph": "M", "ts": 0, "pid": DEVICE, "tid": 0,
         "args": {"labels": "GPU 0"}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": DEVICE, "tid": STREAM,
         "args": {"name": "stream 7 "}},
    ]  # fmt: skip
    events += op("ProfilerStep#4", 0, 1000, 1, cat="user_annotation")
    # a linear: addmm launches a GEMM
    events += op("aten::linear", 10, 100, 2)
    events += op("aten::t", 12, 5, 3)
    events += op("aten::addmm", 20, 60, 4)
    events += launch("cudaLaunchKernel", 30, 8, 101, 4)
    # a host-to-device copy, and a zero_ whose fill_ launches a memset
    events += op("aten::copy_", 120, 40, 5)
    events += launch("cudaMemcpyAsync", 125, 20, 102, 5, cbid=41)
    events += op("aten::zero_", 170, 20, 6)
    events += op("aten::fill_", 172, 15, 7)
    events += launch("cudaMemsetAsync", 175, 5, 103, 7, cbid=51)
    # a second linear
    events += op("aten::linear", 200, 100, 8)
    events += op("aten::addmm", 210, 80, 9)
    events += launch("cudaLaunchKernel", 220, 6, 104, 9)
    # a compiled region: Triton launches through the driver API
    events += op("Torch-Compiled Region: 0/0", 320, 50, 10, cat="user_annotation")
    events += op("CompiledFunction", 325, 40, 11)
    events += launch("cuLaunchKernelEx", 330, 4, 105, 11, cat="cuda_driver", cbid=652)
    events += launch("cuLaunchKernelEx", 340, 4, 106, 11, cat="cuda_driver", cbid=652)
    # launched inside the step mark but no operator
    events += launch("cudaLaunchKernel", 400, 5, 107, 1)
    # an all-reduce on its own stream
    events += op("nccl:all_reduce", 440, 40, 12)
    events += op("record_param_comms", 445, 30, 13)
    events += launch("cudaLaunchKernel", 455, 5, 110, 13)
    # the backward thread
    events += op(BACKWARD_OP, 500, 80, 14, tid=BACKWARD)
    events += op("MmBackward0", 505, 70, 15, tid=BACKWARD)
    events += op("aten::mm", 510, 50, 16, tid=BACKWARD)
    events += launch("cudaLaunchKernel", 515, 6, 109, 16, tid=BACKWARD)
    # a synchronisation: no flow, no GPU work (its cuda_sync event is not GPU time)
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize",
                   "pid": PID, "tid": HOST, "ts": 900, "dur": 95,
                   "args": {"External id": 1, "cbid": 165, "correlation": 108}})  # fmt: skip
    events.append({"ph": "X", "cat": "cuda_sync", "name": "Device Synchronize", "pid": DEVICE,
                   "tid": STREAM, "ts": 1151, "dur": 8,
                   "args": {"cuda_sync_kind": "Device Synchronize", "stream": -1,
                            "correlation": 108, "device": DEVICE, "context": 1}})  # fmt: skip
    # the GPU side, stream 7 in order, then the all-reduce's stream
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4",
                   "pid": DEVICE, "tid": STREAM, "ts": 199, "dur": 966,
                   "args": {"External id": 1}})  # fmt: skip
    events += on_gpu(GEMM, 200, 400.5, 101, 4)
    events += on_gpu(MEMCPY, 610, 12.25, 102, 5, cat="gpu_memcpy")
    events += on_gpu(MEMSET, 625, 2.75, 103, 7, cat="gpu_memset")
    events += on_gpu(GEMM, 630, 300.5, 104, 9)
    events += on_gpu(TRITON, 935, 20.25, 105, 11)
    events += on_gpu(TRITON, 960, 20.25, 106, 11)
    events += on_gpu(ELEMENTWISE, 985, 5.0, 107, 1)  # the step mark's External id
    events += on_gpu(GEMM, 1000, 150.25, 109, 16)
    # its launch is not in the trace (a dropped record): the External id names the operator
    events += on_gpu(FILL, 1160, 3.25, 111, 7, flow=False)
    events += on_gpu(NCCL, 700, 100.0, 110, 13, stream=NCCL_STREAM)
    events.append({"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "",
                   "ts": 1200})  # fmt: skip
    return {
        "schemaVersion": 1,
        "deviceProperties": [
            {
                "id": 0,
                "name": "NVIDIA H100 80GB HBM3",
                "totalGlobalMem": 85029158912,
                "computeMajor": 9,
                "computeMinor": 0,
                "numSms": 132,
            }
        ],
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 1759300000000000000,
        "traceEvents": events,
        "traceName": "rank0.json",
    }


TOTAL_US = 400.5 + 12.25 + 2.75 + 300.5 + 20.25 + 20.25 + 5.0 + 150.25 + 3.25 + 100.0


def test_gpu_time_per_operator():
    gpu = reports.gpu_profile(cuda_trace())
    assert TOTAL_US == 1015.0
    assert gpu.gpu_us == 1015.0  # no gpu_user_annotation, no cuda_sync
    assert gpu.unattributed_us == 5.0  # launched in the step mark, outside any operator
    assert gpu.streams == 2
    ops = {o.name: o for o in gpu.ops}
    assert "ProfilerStep#4" not in ops
    # (calls, GPU time launched itself, with the nested operators', CPU self, CPU total)
    want = {
        "aten::addmm": (2, 701.0, 701.0, 140, 140),  # both GEMMs on stream 7
        "aten::mm": (1, 150.25, 150.25, 50, 50),  # the backward thread's
        "record_param_comms": (1, 100.0, 100.0, 30, 30),  # NCCL, on stream 13
        "CompiledFunction": (1, 40.5, 40.5, 40, 40),  # two Triton launches by the driver API
        "aten::copy_": (1, 12.25, 12.25, 40, 40),
        "aten::fill_": (1, 6.0, 6.0, 15, 15),  # the memset + the fill found by External id
        "aten::linear": (2, 0.0, 701.0, 35 + 20, 200),  # nothing of its own: the addmms'
        "aten::zero_": (1, 0.0, 6.0, 5, 20),
        "Torch-Compiled Region: 0/0": (1, 0.0, 40.5, 10, 50),
        "nccl:all_reduce": (1, 0.0, 100.0, 10, 40),
        "MmBackward0": (1, 0.0, 150.25, 20, 70),
        BACKWARD_OP: (1, 0.0, 150.25, 10, 80),
        "aten::t": (1, 0.0, 0.0, 5, 5),
    }
    got = {
        name: (o.calls, o.gpu_us, o.gpu_total_us, o.cpu_self_us, o.cpu_total_us)
        for name, o in ops.items()
    }
    assert got == want
    # by GPU time launched, then CPU self time
    assert [o.name for o in gpu.ops] == [
        "aten::addmm", "aten::mm", "record_param_comms", "CompiledFunction", "aten::copy_",
        "aten::fill_", "aten::linear", "MmBackward0", "Torch-Compiled Region: 0/0", BACKWARD_OP,
        "nccl:all_reduce", "aten::t", "aten::zero_",
    ]  # fmt: skip
    # (ties by name)
    # what the operators launched and what no operator launched is all the GPU time
    assert sum(o.gpu_us for o in gpu.ops) + gpu.unattributed_us == gpu.gpu_us


def test_top_kernels_by_gpu_time():
    gpu = reports.gpu_profile(cuda_trace())
    got = [(k.name, k.kind, k.calls, k.gpu_us, k.launched_by) for k in gpu.kernels]
    assert got == [
        (GEMM, "kernel", 3, 851.25, "aten::addmm"),  # 701 from addmm, 150.25 from mm
        (NCCL, "kernel", 1, 100.0, "record_param_comms"),
        (TRITON, "kernel", 2, 40.5, "CompiledFunction"),
        (MEMCPY, "gpu_memcpy", 1, 12.25, "aten::copy_"),
        (ELEMENTWISE, "kernel", 1, 5.0, None),
        (FILL, "kernel", 1, 3.25, "aten::fill_"),
        (MEMSET, "gpu_memset", 1, 2.75, "aten::fill_"),
    ]


def test_flow_events_link_activities_without_a_correlation_arg():
    """A producer that writes no `correlation` in args: the "ac2g" pair links the activity (by
    its stream and start) to the launch (by its thread and start), with the same result."""
    trace = cuda_trace()
    for e in trace["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"):
            e["args"].pop("correlation")
    assert reports.gpu_profile(trace) == reports.gpu_profile(cuda_trace())


def test_launches_outside_every_operator_span_fall_back_to_the_external_id():
    """Launches on a thread without operators (here: moved to another tid): each activity's
    `External id`, kineto's link to the operator that launched it, gives the same answer."""
    trace = cuda_trace()
    for e in trace["traceEvents"]:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") or e.get("ph") == "s":
            e["tid"] = 9999
    assert reports.gpu_profile(trace) == reports.gpu_profile(cuda_trace())


def test_a_cpu_trace_has_no_gpu_profile():
    trace = cuda_trace()
    trace["traceEvents"] = [
        e for e in trace["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")
    ]
    assert reports.gpu_profile(trace) is None
    unchanged = copy.deepcopy(trace)
    reports.gpu_profile(unchanged)
    assert unchanged == trace


# --- the command ---
OP_ROW = re.compile(
    r"^(?P<name>.+?)\s+cpu\s+(?P<calls>\d+)\s+(?P<gpu>[\d.]+)\s+(?P<pct>[\d.]+)%\s+"
    r"(?P<gpu_total>[\d.]+)\s+(?P<cpu_self>[\d.]+)\s+(?P<cpu_total>[\d.]+)$"
)
KERNEL_ROW = re.compile(
    r"^(?P<name>.+?)\s+gpu\s+(?P<calls>\d+)\s+(?P<gpu>[\d.]+)\s+(?P<pct>[\d.]+)%\s+"
    r"(?P<mean>[\d.]+)\s+(?P<by>.+?)\s*$"
)


def test_profile_command_on_a_cuda_trace(tmp_path, run_cli):
    window = tmp_path / "run" / "profiles" / "step-4"
    window.mkdir(parents=True)
    (window / "rank0.json").write_text(json.dumps(cuda_trace()))
    code, out, err = run_cli("profile", tmp_path / "run", "--top", "5")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{window / 'rank0.json'}: top 5 of 13 operators by GPU time")
    assert "1.015 ms of GPU time on 2 stream(s)" in lines[0]
    assert lines[1].split() == [
        "operator", "device", "calls", "gpu", "ms", "gpu", "%", "gpu", "total", "ms", "cpu",
        "self", "ms", "cpu", "total", "ms",
    ]  # fmt: skip
    ops = [OP_ROW.match(line).groupdict() for line in lines[2:7]]
    assert [(o["name"], o["calls"], o["gpu"], o["pct"], o["gpu_total"]) for o in ops] == [
        ("aten::addmm", "2", "0.701", "69.1", "0.701"),
        ("aten::mm", "1", "0.150", "14.8", "0.150"),
        ("record_param_comms", "1", "0.100", "9.9", "0.100"),
        ("CompiledFunction", "1", "0.041", "4.0", "0.041"),
        ("aten::copy_", "1", "0.012", "1.2", "0.012"),
    ]
    assert (ops[0]["cpu_self"], ops[0]["cpu_total"]) == ("0.140", "0.140")
    assert lines[7] == "launched outside any operator: 0.005 ms (0.5% of the GPU time)"
    assert lines[8] == ""
    assert lines[9] == "top 5 of 7 GPU kernels, copies and sets by GPU time"
    assert lines[10].split()[:3] == ["kernel", "device", "calls"]
    assert lines[10].endswith("launched by")
    kernels = [KERNEL_ROW.match(line).groupdict() for line in lines[11:16]]
    assert [(k["calls"], k["gpu"], k["pct"], k["mean"], k["by"]) for k in kernels] == [
        ("3", "0.851", "83.9", "283.8", "aten::addmm"),
        ("1", "0.100", "9.9", "100.0", "record_param_comms"),
        ("2", "0.041", "4.0", "20.2", "CompiledFunction"),
        ("1", "0.012", "1.2", "12.2", "aten::copy_"),
        ("1", "0.005", "0.5", "5.0", "-"),
    ]
    # kernel names longer than 80 characters are cut
    assert kernels[0]["name"] == GEMM[:79] + "…"
    assert kernels[3]["name"] == MEMCPY
    assert len(lines) == 16
    assert " gpu " in out  # what the GPU test of integration_tests looks for
    # --json: the same numbers, machine-readable
    code, out, err = run_cli("profile", tmp_path / "run", "--top", "5", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["trace"] == str(window / "rank0.json")
    got = [(op["name"], op["calls"], round(op["gpu_us"] / 1e3, 3)) for op in document["gpu"]["ops"]]
    assert got[:2] == [("aten::addmm", 2, 0.701), ("aten::mm", 1, 0.15)] and len(got) == 5
    assert len(document["gpu"]["kernels"]) == 5 and document["gpu"]["streams"] == 2

    # by CPU self time instead
    code, out, err = run_cli("profile", window / "rank0.json", "--top", "2", "--sort", "cpu")
    assert code == 0, err
    lines = out.splitlines()
    assert "top 2 of 13 operators by CPU self time" in lines[0]
    assert [OP_ROW.match(line)["name"] for line in lines[2:4]] == ["aten::addmm", "aten::linear"]


def test_profile_command_on_a_cpu_trace_is_unchanged(tmp_path, run_cli):
    trace = {
        "traceEvents": [
            *op("ProfilerStep#1", 0, 500, 1, cat="user_annotation"),
            *op("aten::linear", 10, 100, 2),
            *op("aten::addmm", 20, 60, 3),
            *op("aten::mm", 200, 30, 4),
        ]
    }
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(trace))
    code, out, err = run_cli("profile", path)
    assert code == 0, err
    assert out.splitlines() == [
        f"{path}: top 3 of 3 operators by self time",
        "operator      device    calls     self ms  self %    total ms",
        "aten::addmm   cpu           1       0.060   46.2%       0.060",
        "aten::linear  cpu           1       0.040   30.8%       0.100",
        "aten::mm      cpu           1       0.030   23.1%       0.030",
    ]
