"""The `llmtrain` command. Its subcommands are plugins of kind `command`, so each package adds its
own (`data ...` from data-pack, `run` and `config ...` from train-loop) and third parties can too.

Every parser follows the command-line convention of `cli_conventions` (defaults in the help, a
mistyped subcommand answered with the closest names, old spellings as deprecated aliases).
Global options (`--debug`) work before or after the subcommand. A command of one of llmtrain's
own packages that is not installed names the package to install. Errors a person can fix
(`UserError`) print as one message and exit 2, once per launch: under torchrun or srun rank 0
prints it, and the other ranks only if they outlive it (`_report_user_error`); anything else is
a bug: one line and exit 1, the traceback only with `--debug`. Startup imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import tomllib
import traceback
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import importlib_metadata

from llmtrain.core_mesh.cli_conventions import ConventionParser
from llmtrain.core_mesh.errors import UserError, no_space, no_space_message
from llmtrain.core_mesh.plugins import COMMAND, PluginManager
from llmtrain.core_mesh.redact import environment_secrets, redact_text

EXIT_USER_ERROR = 2
EXIT_BUG = 1
# how long a rank other than 0 waits before printing a user error (rank 0 prints it; see
# `_report_user_error`)
RANK_ERROR_GRACE_S = 20.0


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


# the commands of llmtrain's own distributions, so that a command whose package is not installed
# is answered with the package to install (core-mesh cannot import the others to ask them)
COMMAND_DISTRIBUTIONS: dict[str, str] = {
    "plugins": "llmtrain-core-mesh",
    "data": "llmtrain-data-pack",
    **dict.fromkeys(
        (
            "run",
            "config",
            "eval",
            "eval-tasks",
            "generate",
            "quickstart",
            "sweep",
            "estimate",
            "which",
            "mup-check",
        ),
        "llmtrain-train-loop",
    ),
    **dict.fromkeys(("export", "checkpoints", "average"), "llmtrain-checkpoint"),
    **dict.fromkeys(("compare", "plot", "profile", "ranks", "fit", "report"), "llmtrain-ablate"),
    "hf": "llmtrain-hf",
    "lm-eval": "llmtrain-lmeval",
}


def _add_global_options(parser: argparse.ArgumentParser, default: object) -> None:
    """The options every command takes, before or after its name. A subcommand's parser gives
    them `argparse.SUPPRESS` as default, so it keeps what an earlier position set."""
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks for errors"
    )


class _CommandParser(ConventionParser):
    """The parser of a subcommand (and of its own subcommands: argparse makes those of the same
    class), which follows the command-line convention (`cli_conventions`). It also takes the
    global options, and a positional list (`KEY=VALUE ...`) may be left out: argparse would name
    it among the missing arguments of `llmtrain run`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _add_global_options(self, default=argparse.SUPPRESS)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings and action.nargs == argparse.ZERO_OR_MORE:
            action.required = False
        return action


def build_parser(plugins: PluginManager) -> argparse.ArgumentParser:
    parser = ConventionParser(
        prog="llmtrain",
        description="LLM pretraining: pack data, train, checkpoint, compare runs.",
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {version()}")
    _add_global_options(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    commands = plugins.registry(COMMAND)
    for entry in commands.values():
        command = plugins.build(COMMAND, entry.name)
        sub_parser = sub.add_parser(entry.name, help=command.help, description=command.help)
        command.configure(sub_parser)
    for name in COMMAND_DISTRIBUTIONS.keys() - commands.names():
        # not offered in the help; taken with any arguments, so `main` can say what to install
        stand_in = sub.add_parser(name, description=_not_installed(name, plugins))
        stand_in.add_argument("arguments", nargs=argparse.REMAINDER, help="the command's")
    return parser


def _not_installed(name: str, plugins: PluginManager) -> str:
    """What to do about a command of llmtrain's own packages that is not here."""
    distribution = COMMAND_DISTRIBUTIONS[name]
    if any(p.origin.distribution == distribution for p in plugins.problems):
        return (
            f"`{name}` is provided by {distribution}, which is installed but failed to load; "
            "see `llmtrain plugins`"
        )
    return f"`{name}` is provided by {distribution}: {install_command(distribution)}"


def install_command(distribution: str, *, installed: Callable[[str], bool] | None = None) -> str:
    """The command that installs one of llmtrain's own distributions here. No package index has
    them: where llmtrain runs from a checkout (`checkout_root`), the command names the checkout's
    paths, the distribution's and those of the llmtrain distributions it needs (recursively)
    that are not `installed`, so that pip resolves them all; elsewhere, the distribution's name.
    The installer is the one of this interpreter (`_installer`)."""
    root = checkout_root()
    paths = _checkout_distributions(root) if root is not None else {}
    if distribution not in paths or root is None:
        return f"{_installer()} {distribution}"
    is_installed = installed or _is_installed
    wanted: list[str] = []

    def visit(name: str) -> None:
        if name in wanted or name not in paths:
            return
        for dependency in _llmtrain_dependencies(paths[name]):
            if not is_installed(dependency):
                visit(dependency)
        wanted.append(name)

    visit(distribution)
    here = Path.cwd().resolve()
    shown = [
        f"./{paths[name].relative_to(root)}" if root == here else str(paths[name])
        for name in wanted
    ]
    return f"{_installer()} {' '.join(shown)}"


def checkout_root() -> Path | None:
    """The llmtrain checkout this core-mesh was installed from, if any: the folder two above
    the path pip recorded for it (`direct_url.json`: an editable or a local-path install) or
    above this file's `packages/core-mesh/src` (a source tree on `sys.path`), which holds the
    root `pyproject.toml` of the distribution `llmtrain` and `packages/`. None for an install
    from a wheel or an index, or a checkout since moved or deleted."""
    candidates = []
    try:
        direct_url = importlib_metadata.distribution("llmtrain-core-mesh").read_text(
            "direct_url.json"
        )
    except importlib_metadata.PackageNotFoundError:
        direct_url = None
    if direct_url:
        try:
            url = json.loads(direct_url).get("url", "")
        except ValueError:
            url = ""
        if isinstance(url, str) and url.startswith("file://"):
            candidates.append(Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)))
    here = Path(__file__).resolve()  # <root>/packages/core-mesh/src/llmtrain/core_mesh/cli.py
    candidates.append(here.parents[3])
    for package in candidates:
        root = package.parent.parent
        if package.parent.name == "packages" and _project_name(root) == "llmtrain":
            return root.resolve()
    return None


def _project_name(folder: Path) -> str | None:
    try:
        with open(folder / "pyproject.toml", "rb") as f:
            name = tomllib.load(f).get("project", {}).get("name")
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) else None


def _checkout_distributions(root: Path) -> dict[str, Path]:
    """The distributions of the checkout's `packages/` and `plugins/`, by name."""
    found = {}
    for folder in sorted([*root.glob("packages/*"), *root.glob("plugins/*")]):
        if (name := _project_name(folder)) is not None:
            found[name] = folder
    return found


def _llmtrain_dependencies(folder: Path) -> list[str]:
    """The `llmtrain-*` distributions a checkout's package declares (extras left out)."""
    try:
        with open(folder / "pyproject.toml", "rb") as f:
            declared = tomllib.load(f).get("project", {}).get("dependencies", [])
    except (OSError, ValueError):
        return []
    names = [re.split(r"[\s\[<>=!~;]", str(d), maxsplit=1)[0] for d in declared]
    return [name for name in names if name.startswith("llmtrain-")]


def _is_installed(distribution: str) -> bool:
    try:
        importlib_metadata.distribution(distribution)
    except importlib_metadata.PackageNotFoundError:
        return False
    return True


def _installer() -> str:
    """`pip install` where this interpreter has pip and the `pip` on the PATH is its own (an
    activated venv); this interpreter's pip by path where another `pip` comes first; `uv pip
    install` for a venv without pip (uv makes them so), aimed at this interpreter."""
    python = sys.executable
    # pip's metadata, not importlib.util.find_spec("pip"): asking the import system for pip
    # switches off setuptools' distutils shim for the rest of the process (it takes it for a
    # pip run), and a later torch.compile then fails to build its C++ kernels
    if _is_installed("pip"):
        on_path = shutil.which("pip")
        if on_path is not None and Path(on_path).parent == Path(python).parent:
            return "pip install"
        return f"{python} -m pip install"
    if shutil.which("uv") is not None:
        return f"uv pip install --python {python}"
    return f"{python} -m pip install"


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Like parse_args, but `key=value` overrides may also follow options (`cfg.yaml --x 1 a=b`)."""
    args, extra = parser.parse_known_args(argv)
    late = [word for word in extra if "=" in word and not word.startswith("-")]
    if late and isinstance(getattr(args, "overrides", None), list):
        args.overrides.extend(late)
        extra = [word for word in extra if word not in late]
    if extra and getattr(args, "command", None):
        # one line, as every other bad input: the command's usage is a --help away
        raise UserError(
            f"llmtrain {args.command}: unrecognized arguments: {' '.join(extra)}; see "
            f"llmtrain {args.command} --help"
        )
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
        if args.command not in plugins.registry(COMMAND):
            raise UserError(_not_installed(args.command, plugins))
        command = plugins.build(COMMAND, args.command)
        return int(command.run(args, Context(plugins, debug)) or 0)
    except UserError as exc:
        if debug:
            _print_redacted(traceback.format_exc())
        _report_user_error(str(exc), debug=debug)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a bug, reported briefly
        if (full := no_space(exc)) is not None:  # not a bug: the disk is full
            _report_user_error(no_space_message(full), debug=debug)
            return EXIT_USER_ERROR
        if debug:
            _print_redacted(traceback.format_exc())
        else:
            _print_redacted(
                f"error: {type(exc).__name__}: {exc}\n"
                "(this is a bug in llmtrain or a plugin; run again with --debug for the traceback)"
            )
        return EXIT_BUG


def _print_redacted(text: str, *, ours: bool = False) -> None:
    """Errors echo what they were given (a signed URL, a client's arguments): stderr ends up in
    shared job logs, so credentials are masked as in the logs. `ours`: a message llmtrain wrote,
    whose `KEY=VALUE` is syntax: only credential values and forms are masked there."""
    known = environment_secrets(os.environ)
    print(redact_text(text.rstrip("\n"), known, assignments=not ours), file=sys.stderr)


def _report_user_error(message: str, *, debug: bool) -> None:
    """Print the error once per launch: rank 0 prints it. Every rank usually meets the same
    error (one config, the same files), and rank 0's exit ends the launch (torchrun stops the
    other ranks) while they wait here; a rank still alive after the wait met an error of its
    own, and says it. `--debug`: every rank at once."""
    rank = _launch_rank()
    if rank != 0 and not debug:
        time.sleep(RANK_ERROR_GRACE_S)
    _print_redacted(f"error: {f'rank {rank}: ' if rank else ''}{message}", ours=True)


def _launch_rank() -> int:
    """This process's rank from its launcher (torchrun's RANK, srun's SLURM_PROCID); 0 without."""
    text = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    try:
        return int(text)
    except ValueError:
        return 0
