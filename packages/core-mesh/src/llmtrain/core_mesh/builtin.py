"""core-mesh's own plugin (entry point `core`): the `llmtrain plugins` command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import json_option
from llmtrain.core_mesh.plugins import DISABLE_ENV, Register, hookimpl


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _configure(parser: argparse.ArgumentParser) -> None:
    json_option(parser)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if any plugin is broken (for CI)"
    )


def _run(args: argparse.Namespace, ctx: Context) -> int:
    plugins = ctx.plugins
    entries = plugins.entries()
    problems = plugins.problems
    if args.json:
        print(
            json.dumps(
                {
                    "entries": [
                        {
                            "kind": e.kind,
                            "name": e.name,
                            "plugin": e.origin.plugin,
                            "package": e.origin.distribution,
                            "version": e.origin.version,
                            "help": e.help,
                        }
                        for e in entries
                    ],
                    "problems": [
                        {
                            "plugin": p.origin.plugin,
                            "package": p.origin.distribution,
                            "version": p.origin.version,
                            "error": p.error,
                        }
                        for p in problems
                    ],
                    "blocked": sorted(plugins.blocked),
                },
                indent=2,
            )
        )
    else:
        rows = [("KIND", "NAME", "PLUGIN", "PACKAGE", "VERSION")]
        rows += [
            (e.kind, e.name, e.origin.plugin, e.origin.distribution or "-", e.origin.version or "-")
            for e in entries
        ]
        print(_table(rows))
        if problems:
            print(f"\nbroken ({len(problems)}):")
            broken = [("PLUGIN", "PACKAGE", "VERSION", "ERROR")]
            broken += [
                (p.origin.plugin, p.origin.distribution or "-", p.origin.version or "-", p.error)
                for p in problems
            ]
            print(_table(broken))
            if ctx.debug:
                for p in problems:
                    if p.detail:
                        print(f"\n{p.origin.plugin}:\n{p.detail}")
        if plugins.blocked:
            print(f"\nblocked by {DISABLE_ENV}: {', '.join(sorted(plugins.blocked))}")
    return 1 if args.check and problems else 0


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "plugins",
        lambda _: Command(
            help="list installed plugins and the ones that failed", configure=_configure, run=_run
        ),
    )
