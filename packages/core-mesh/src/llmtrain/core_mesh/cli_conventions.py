"""The command-line convention every `llmtrain` subcommand follows (the root README's
"Command-line conventions"; `integration_tests/test_cli_conventions.py` holds it):

- the main object (a config, a checkpoint, runs, datasets) is positional: `main_object`;
- `-o/--output` names what a command writes, its metavar what that is (`DIR`, `DATASET`, `FILE`
  or `FILE.<suffix>`); a second output has a flag of its own (`fit --plot FILE`); `--json` asks
  for machine-readable output (`json_option`: one wording);
- every option has a help line, and the help shows its default (`HelpFormatter`);
- a mistyped subcommand gets the closest names (`unknown_subcommand`), exit 2;
- an old spelling keeps working for one release as a hidden alias that prints one deprecation
  line on stderr naming the new spelling (`deprecated_alias`, and `main_object(old=...)` for an
  option that became the positional).

`ConventionParser` is the parser class that does the parsing side of this (the core-mesh CLI
makes every subcommand's parser one): it replaces old spellings by new ones (with their lines)
before argparse sees them, and hands what follows `--` to a `passthrough` command.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, TypeVar, overload

from llmtrain.core_mesh.errors import UserError

_N = TypeVar("_N")

# the last release in which the old spellings work; they go in the one after it
DEPRECATED_UNTIL = "0.2"

# words people type for a command that has another name here
COMMAND_SYNONYMS = {"train": "run", "evaluate": "eval", "sample": "generate", "pack": "data"}


def _no_default(value: object) -> bool:
    """A default not worth showing: none, off, empty text, or an empty list (an `append`
    option)."""
    return (
        value is None
        or value is False
        or value == ""
        or value is argparse.SUPPRESS
        or (isinstance(value, list | tuple) and not value)
    )


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, and each option's help ends with its default where it has one and
    does not already say it (`(default: ...)`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help
        if help is None or help is argparse.SUPPRESS or _no_default(action.default):
            return help
        if "default" in help.lower():
            return help
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, "*"):
            return help
        return f"{help} (default: %(default)s)"


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An action's help line as `--help` prints it (defaults filled in)."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def warn_deprecated(text: str) -> None:
    """One line on stderr for an old spelling: `text`, then when the spelling goes away."""
    print(f"warning: {text} (the old spelling goes away after {DEPRECATED_UNTIL})", file=sys.stderr)


class DeprecatedAlias(argparse.Action):
    """A hidden old spelling of an option: does what `target` does, after one line on stderr.
    (A `ConventionParser` replaces the old spelling by the new one before parsing, so a required
    target counts as given; this action is what a plain parser does with it.)"""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, target: argparse.Action, **kw: Any
    ) -> None:
        self.target = target
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        new = "/".join(self.target.option_strings)
        warn_deprecated(f"{parser.prog}: {option_string} is deprecated; use {new}")
        self.target(parser, namespace, values, option_string)


def _option(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    action = parser._option_string_actions.get(name)
    if action is None:
        raise ValueError(f"{parser.prog} has no option {name}")
    return action


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> argparse.Action:
    """Make `old` (an option's earlier spelling) work like the option `new` for one more
    release: hidden from the help, printing one deprecation line on stderr."""
    target = _option(parser, new)
    # `add_argument`'s stub takes no `type=None`; leaving it out is the same
    typed: dict[str, Any] = {} if target.type is None else {"type": target.type}
    return parser.add_argument(
        old,
        action=DeprecatedAlias,
        target=target,
        dest=target.dest,
        nargs=target.nargs,
        **typed,
        choices=target.choices,
        metavar=target.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


class DeprecatedMainOption(argparse.Action):
    """The option that named a command's main object before it became positional (`--checkpoint
    DIR`). `ConventionParser` moves `--checkpoint DIR` to the front of the command's arguments
    before parsing, with one deprecation line; on another parser the option stores the value."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, positional: argparse.Action, **kw: Any
    ) -> None:
        self.positional = positional
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        warn_deprecated(self.message(parser.prog, option_string or self.option_strings[0]))
        setattr(namespace, self.dest, values)

    def message(self, prog: str, option: str) -> str:
        name = self.positional.metavar or self.positional.dest.upper()
        return f"{prog}: {option} {name} is deprecated; use {prog} {name}"


# `--json`'s help on every command, before what else the flag changes on one
JSON_HELP = "print JSON instead of text"


def json_option(parser: argparse.ArgumentParser, *, also: str = "") -> None:
    """`--json`: machine output on stdout in place of the tables or text, in one wording for
    every command; `also`: what else it changes on this one."""
    parser.add_argument(
        "--json", action="store_true", help=JSON_HELP + (f"; {also}" if also else "")
    )


def positive_int(text: str) -> int:
    """An option's value that counts something (`--last 4`): a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main_object(
    parser: argparse.ArgumentParser,
    dest: str,
    *,
    help: str,
    metavar: str | None = None,
    nargs: str | int | None = None,
    old: str | None = None,
) -> argparse.Action:
    """The command's main object, positional (`llmtrain eval CHECKPOINT`); `old`: the option
    that named it before (`--checkpoint`), kept as a hidden deprecated alias."""
    positional = parser.add_argument(dest, metavar=metavar, nargs=nargs, help=help)
    if old is not None:
        parser.add_argument(
            old,
            action=DeprecatedMainOption,
            positional=positional,
            dest=dest,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    return positional


PASSTHROUGH = "_llmtrain_passthrough"


def passthrough(
    parser: argparse.ArgumentParser, dest: str, *, help: str, metavar: str = "OPTIONS"
) -> None:
    """What follows `--` goes, as a list, to `dest` (another program's options, like lm_eval's
    for `llmtrain lm-eval`), so the command's own options may come before or after its
    positionals. A `ConventionParser` does the split, and its usage line ends with
    `[-- METAVAR ...]`; the help's epilog says what goes there."""
    setattr(parser, PASSTHROUGH, dest)
    setattr(parser, PASSTHROUGH + "_metavar", metavar)
    parser.set_defaults(**{dest: []})
    parser.epilog = f"after --: {help}"


def unknown_subcommand(word: str, choices: Iterable[str], *, what: str = "command") -> str:
    """One line for an unknown subcommand: the closest names, else where to look."""
    names = list(choices)
    synonyms = {k: v for k, v in COMMAND_SYNONYMS.items() if v in names and k not in names}
    known = {**{n: n for n in names}, **synonyms}
    close = [word] if word in synonyms else difflib.get_close_matches(word, list(known), cutoff=0.6)
    suggestions = list(dict.fromkeys(known[c] for c in close))
    if suggestions:
        return f"{word!r} is not a {what}; did you mean: {', '.join(suggestions)}?"
    return f"{word!r} is not a {what}; the {what}s: {', '.join(sorted(names))}"


class ConventionParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` that shows defaults in its help, answers a mistyped
    subcommand with the closest names (a `UserError`: one line, exit 2), and takes the old
    option spelling of a positional main object (`DeprecatedMainOption`). Its subparsers are of
    the same class unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """A bad argument is one line, like every other bad input (`error: llmtrain CMD:
        MESSAGE; see llmtrain CMD --help`, exit 2): the usage is a --help away."""
        raise UserError(f"{self.prog}: {message}; see {self.prog} --help")

    @overload  # the overloads of `argparse.ArgumentParser.parse_known_args`
    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(
        self, args: Iterable[str] | None, namespace: _N
    ) -> tuple[_N, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: _N) -> tuple[_N, list[str]]: ...

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: object = None
    ) -> tuple[object, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        dest = getattr(self, PASSTHROUGH, None)
        passed: list[str] = []
        if dest is not None and "--" in args:
            args, passed = args[: args.index("--")], args[args.index("--") + 1 :]
        namespace, extra = super().parse_known_args(self._new_spellings(args), namespace)
        if dest is not None:
            setattr(namespace, dest, passed)
        return namespace, extra

    def format_usage(self) -> str:
        return self._usage_with_passthrough(super().format_usage())

    def format_help(self) -> str:
        return self._usage_with_passthrough(super().format_help())

    def _usage_with_passthrough(self, text: str) -> str:
        """The usage (the text up to its first blank line) ends with `[-- METAVAR ...]`."""
        if getattr(self, PASSTHROUGH, None) is None:
            return text
        end = text.find("\n\n")
        end = len(text.rstrip("\n")) if end < 0 else end
        metavar = getattr(self, PASSTHROUGH + "_metavar", "OPTIONS")
        return f"{text[:end]} [-- {metavar} ...]{text[end:]}"

    def _new_spellings(self, args: list[str]) -> list[str]:
        """The arguments with this parser's old spellings replaced by the new ones, each with
        its deprecation line: `--out X` becomes `--output X`, and `--checkpoint DIR` (or
        `--checkpoint=DIR`) of a command whose checkpoint is now positional becomes `DIR`,
        first. Up to a `--`; a parser with subcommands leaves their arguments alone only if it
        has no old spellings itself (none of llmtrain's has)."""
        old = {
            option: action
            for action in self._actions
            if isinstance(action, DeprecatedAlias | DeprecatedMainOption)
            for option in action.option_strings
        }
        if not old:
            return args
        moved: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            if word == "--":
                rest += args[i:]
                break
            name, eq, value = word.partition("=")
            action = old.get(name) if word.startswith("--") else None
            if isinstance(action, DeprecatedAlias):
                spellings = action.target.option_strings
                warn_deprecated(f"{self.prog}: {name} is deprecated; use {'/'.join(spellings)}")
                rest.append(spellings[-1] + eq + value)
            elif isinstance(action, DeprecatedMainOption) and (eq or i + 1 < len(args)):
                if not eq:
                    value = args[i + 1]
                    i += 1
                warn_deprecated(action.message(self.prog, name))
                moved.append(value)
            else:
                rest.append(word)
            i += 1
        return moved + rest

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if (
            isinstance(action, argparse._SubParsersAction)
            and action.choices is not None
            and value not in action.choices
        ):
            what = "command" if self.prog == "llmtrain" else "subcommand"
            raise UserError(
                f"{self.prog}: {unknown_subcommand(str(value), action.choices, what=what)}"
            )
        super()._check_value(action, value)
