"""The command-line convention's helpers: defaults in the help, deprecated aliases that still
work with one line on stderr, the positional main object with its old option, `--` passthrough,
did-you-mean."""

from __future__ import annotations

import argparse

import pytest

from llmtrain.core_mesh.cli_conventions import (
    ConventionParser,
    DeprecatedAlias,
    DeprecatedMainOption,
    deprecated_alias,
    main_object,
    passthrough,
    shown_help,
    unknown_subcommand,
)
from llmtrain.core_mesh.errors import UserError


def parser() -> ConventionParser:
    p = ConventionParser(prog="llmtrain eval")
    main_object(p, "checkpoint", metavar="CHECKPOINT", help="a checkpoint", old="--checkpoint")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    deprecated_alias(p, "--batch", "--batch-size")
    p.add_argument("-o", "--output", required=True, help="where to write")
    deprecated_alias(p, "--out", "--output")
    p.add_argument("--steps", type=int, default=None, help="how many (default: all)")
    p.add_argument("--verbose", action="store_true", help="say more")
    p.add_argument("--name", default="", help="a name")
    return p


def test_the_help_shows_each_default_once_and_hides_the_old_spellings(capsys):
    p = parser()
    helps = {a.dest: shown_help(p, a) for a in p._actions if a.help != argparse.SUPPRESS}
    assert helps["batch_size"] == "rows per forward pass (default: 8)"
    assert helps["steps"] == "how many (default: all)"  # says it already
    assert helps["verbose"] == "say more"  # off: nothing to show
    assert helps["name"] == "a name"  # empty text: nothing to show
    text = p.format_help()
    assert "CHECKPOINT" in text and "--batch-size" in text
    assert "--checkpoint" not in text and "--batch " not in text and "--out " not in text


def test_old_spellings_work_with_one_line_each(capsys):
    args = parser().parse_args(["--batch", "3", "--out", "x", "--checkpoint", "ck"])
    assert (args.checkpoint, args.batch_size, args.output) == ("ck", 3, "x")
    assert capsys.readouterr().err.splitlines() == [
        "warning: llmtrain eval: --batch is deprecated; use --batch-size "
        "(the old spelling goes away after 0.2)",
        "warning: llmtrain eval: --out is deprecated; use -o/--output "
        "(the old spelling goes away after 0.2)",
        "warning: llmtrain eval: --checkpoint CHECKPOINT is deprecated; use llmtrain eval "
        "CHECKPOINT (the old spelling goes away after 0.2)",
    ]
    args = parser().parse_args(["-o", "x", "--checkpoint=ck", "--batch=5"])
    assert (args.checkpoint, args.batch_size) == ("ck", 5)
    args = parser().parse_args(["ck", "-o", "x"])
    assert (args.checkpoint, args.batch_size) == ("ck", 8)
    assert capsys.readouterr().err.count("deprecated") == 2


def test_the_aliases_are_marked_for_the_convention_test():
    p = parser()
    old = {s: a for a in p._actions for s in a.option_strings if a.help == argparse.SUPPRESS}
    assert isinstance(old["--batch"], DeprecatedAlias)
    assert old["--batch"].target.option_strings == ["--batch-size"]
    assert isinstance(old["--checkpoint"], DeprecatedMainOption)


def test_a_plain_parser_still_takes_an_old_option(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--world-size", type=int, default=1, help="ranks")
    deprecated_alias(p, "--world", "--world-size")
    assert p.parse_args(["--world", "4"]).world_size == 4
    assert "--world is deprecated; use --world-size" in capsys.readouterr().err


def test_what_follows_a_double_dash_is_passed_through():
    p = ConventionParser(prog="llmtrain lm-eval")
    main_object(p, "checkpoint", help="a checkpoint", old="--checkpoint")
    p.add_argument("--step", type=int, default=None, help="which step")
    passthrough(p, "harness", help="lm_eval's options")
    args = p.parse_args(["ck", "--step", "4", "--", "--tasks", "t", "--step", "9"])
    assert (args.checkpoint, args.step, args.harness) == ("ck", 4, ["--tasks", "t", "--step", "9"])
    args = p.parse_args(["--checkpoint", "ck", "--", "--checkpoint", "other"])
    assert (args.checkpoint, args.harness) == ("ck", ["--checkpoint", "other"])
    assert p.parse_args(["ck"]).harness == []
    assert "after --: lm_eval's options" in p.format_help()
    assert p.format_usage().rstrip().endswith("checkpoint [-- OPTIONS ...]")


def test_did_you_mean():
    names = ["compare", "run", "ranks", "eval", "eval-tasks"]
    assert (
        unknown_subcommand("compre", names) == "'compre' is not a command; did you mean: compare?"
    )
    assert unknown_subcommand("train", names).endswith("did you mean: run?")
    assert unknown_subcommand("zzz", names) == (
        "'zzz' is not a command; the commands: compare, eval, eval-tasks, ranks, run"
    )
    p = ConventionParser(prog="llmtrain data")
    actions = p.add_subparsers(dest="action")
    actions.add_parser("pack")
    with pytest.raises(UserError, match=r"^llmtrain data: 'pakc' is not a subcommand; did you "):
        p.parse_args(["pakc"])
