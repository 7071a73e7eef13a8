"""ablate's plugin (entry point `ablate`): the commands that read run directories back
(`compare`, `plot`, `fit`, `report`, `profile`, `ranks`). Loading it imports no torch, no
scipy and no matplotlib."""

from __future__ import annotations

from llmtrain.ablate import compare, fit_command, html_report, plot, reports
from llmtrain.core_mesh.cli import Command
from llmtrain.core_mesh.plugins import Register, hookimpl


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "profile",
        lambda _: Command(
            help="the top operators by self time in a run's profiler trace; on a CUDA trace "
            "the GPU time each operator launched and the top kernels",
            configure=reports.configure_profile,
            run=reports.run_profile,
        ),
    )
    register(
        "ranks",
        lambda _: Command(
            help="per-rank step time, data and sync wait, memory: which rank is the slowest",
            configure=reports.configure_ranks,
            run=reports.run_ranks,
        ),
    )
    register(
        "compare",
        lambda _: Command(
            help="a table of runs or sweeps: what varies, eval loss, downstream metrics, "
            "tokens/s; with --baseline each row's difference, p-value and verdict",
            configure=compare.configure,
            run=compare.run,
        ),
    )
    register(
        "plot",
        lambda _: Command(
            help="loss and downstream-metric curves of runs or sweeps (PNG/SVG; needs matplotlib)",
            configure=plot.configure,
            run=plot.run,
        ),
    )
    register(
        "fit",
        lambda _: Command(
            help="scaling-law fits of runs varying model size and tokens: L(N, D) with "
            "bootstrap intervals, IsoFLOP optima, predictions; --mixture: the best data "
            "mixture of a mixture sweep",
            configure=fit_command.configure,
            run=fit_command.run,
        ),
    )
    register(
        "report",
        lambda _: Command(
            help="one self-contained HTML page of runs or sweeps: the verdict, the compare "
            "table with intervals and significance, curves, scaling-law fits, the best data "
            "mixture of a mixture sweep, each run's settings",
            configure=html_report.configure,
            run=html_report.run,
        ),
    )
