"""The `llmtrain` command. Its subcommands are plugins of kind `command`, so each package adds its
own (`data ...` from data-pack, `run` and `config ...` from train-loop) and third parties can too.

Errors a person can fix (`UserError`) print as one message and exit 2; anything else is a bug:
one line and exit 1, the traceback only with `--debug`. Startup imports no torch.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

import attrs
import importlib_metadata

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager

EXIT_USER_ERROR = 2
EXIT_BUG = 1


@attrs.frozen
class Context:
    plugins: PluginManager
    debug: bool = False


@attrs.frozen
class Command:
    """A subcommand: `configure` adds its arguments, `run` does the work and returns an exit code."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Context], int | None]


def version() -> str:
    return importlib_metadata.version("llmtrain-core-mesh")


def build_parser(plugins: PluginManager) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmtrain",
        description="LLM pretraining: pack data, train, checkpoint, compare runs.",
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in plugins.registry("command").values():
        command: Command = entry.target
        sub_parser = sub.add_parser(entry.name, help=command.help, description=command.help)
        command.configure(sub_parser)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Like parse_args, but `key=value` overrides may also follow options (`cfg.yaml --x 1 a=b`)."""
    args, extra = parser.parse_known_args(argv)
    late = [word for word in extra if "=" in word and not word.startswith("-")]
    if late and isinstance(getattr(args, "overrides", None), list):
        args.overrides.extend(late)
        extra = [word for word in extra if word not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None, *, plugins: PluginManager | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        if plugins is None:
            plugins = PluginManager().load_entry_points()
        parser = build_parser(plugins)
        args = _parse(parser, argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USER_ERROR
        if plugins.problems and args.command != "plugins":
            n = len(plugins.problems)
            print(
                f"warning: {n} plugin problem{'s' if n > 1 else ''}; see `llmtrain plugins`",
                file=sys.stderr,
            )
        command: Command = plugins.registry("command").get(args.command).target
        return int(command.run(args, Context(plugins, debug)) or 0)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a bug, reported briefly
        if debug:
            traceback.print_exc()
        else:
            print(
                f"error: {type(exc).__name__}: {exc}\n"
                "(this is a bug in llmtrain or a plugin; run again with --debug for the traceback)",
                file=sys.stderr,
            )
        return EXIT_BUG
