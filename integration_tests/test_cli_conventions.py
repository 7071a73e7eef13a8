"""The command-line convention (root README, "Command-line conventions"), held for every
subcommand of every installed package and plugin: the real top-level parser is built from the
installed plugins and every subcommand's parser is walked (its own subcommands too).

- every option has a help line, and the help shows its default where it has one;
- what a command writes is `-o/--output` with a metavar that says what it is (`OUTPUTS`),
  machine output is `--json` with one wording (`JSON_HELP`), no `--format`;
- a positional is named in capitals (CONFIG, RUN_OR_SWEEP), as argparse shows options' values;
- one concept, one flag name across commands (`CONCEPTS`);
- the main object positional on the commands the README lists (`MAIN_OBJECTS`);
- old spellings hidden from the help, yet working with one deprecation line (`OLD_SPELLINGS`);
- a mistyped subcommand: one did-you-mean line, exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support import ROOT

from llmtrain.core_mesh.cli import _parse, build_parser
from llmtrain.core_mesh.cli_conventions import (
    JSON_HELP,
    DeprecatedAlias,
    DeprecatedMainOption,
    shown_help,
)
from llmtrain.core_mesh.plugins import PluginManager

# the main object of each command, positional, with the name its help shows
MAIN_OBJECTS = {
    "run": "CONFIG",
    "sweep": "CONFIG",
    "estimate": "CONFIG",
    "config validate": "CONFIG",
    "config show": "CONFIG",
    "eval": "CHECKPOINT",
    "eval-tasks": "CHECKPOINT",
    "generate": "CHECKPOINT",
    "export": "CHECKPOINT",
    "checkpoints": "CHECKPOINT",
    "hf export": "CHECKPOINT",
    "lm-eval": "CHECKPOINT",
    "hf import": "HF_DIR",
    "which": "RUN",
    "ranks": "RUN",
    "profile": "RUN",
    "compare": "RUN_OR_SWEEP",
    "plot": "RUN_OR_SWEEP",
    "fit": "RUN_OR_SWEEP",
    "report": "RUN_OR_SWEEP",
    "data pack": "INPUT",
    "data pack-chat": "INPUT",
    "data train-tokenizer": "INPUT",
    "data inspect": "DATASET",
    "data merge": "DATASET",
}

# what `-o` names: a directory, a dataset (a zarr directory), or a file, with its suffix where
# the command writes one kind
OUTPUTS = re.compile(r"DIR|DATASET|FILE(\.[a-z]+)?")

# one concept, one flag: a visible option may not be spelt like the left side
CONCEPTS = {
    # ranks
    "--world": "--world-size",
    "--nprocs": "--world-size",
    "--num-processes": "--world-size",
    # rows per forward pass
    "--batch": "--batch-size",
    "--batch-rows": "--batch-size",
    "--bs": "--batch-size",
    # tokens per row
    "--max-len": "--seq-len",
    "--max-length": "--seq-len",
    "--seqlen": "--seq-len",
    "--context-length": "--seq-len",
    # how long to train
    "--num-steps": "--steps",
    "--max-steps": "--steps",
    "--iters": "--steps",
    "--random-seed": "--seed",
    "--task": "--tasks",
    "--dryrun": "--dry-run",
    "--dry": "--dry-run",
    # what a command writes, and machine output
    "--out": "-o/--output",
    "--outdir": "-o/--output",
    "--output-dir": "-o/--output",
    "--output-file": "-o/--output",
    "--format": "--json (or the output's suffix)",
    "--output-format": "--json (or the output's suffix)",
    "--as-json": "--json",
    # the main object is positional
    "--checkpoint": "the positional CHECKPOINT",
    "--ckpt": "the positional CHECKPOINT",
    "--config": "the positional CONFIG",
}

# 0.1's spellings: (command, the old spelling, argv after the command) -> (what the parse
# gives, the new spelling its line names)
OLD_SPELLINGS = [
    ("eval", "--checkpoint", ["--checkpoint", "CK", "--data", "d"], {"checkpoint": "CK"}, "eval CHECKPOINT"),
    ("eval", "--batch", ["CK", "--data", "d", "--batch", "3"], {"batch_size": 3}, "--batch-size"),
    ("generate", "--checkpoint", ["--checkpoint", "CK"], {"checkpoint": "CK"}, "generate CHECKPOINT"),
    ("eval-tasks", "--checkpoint", ["--tasks", "a=b", "--checkpoint=CK"], {"checkpoint": "CK"}, "eval-tasks CHECKPOINT"),
    ("eval-tasks", "--batch-rows", ["CK", "--tasks", "a=b", "--batch-rows", "5"], {"batch_size": 5}, "--batch-size"),
    ("eval-tasks", "--max-len", ["CK", "--tasks", "a=b", "--max-len", "64"], {"seq_len": 64}, "--seq-len"),
    ("lm-eval", "--checkpoint", ["--checkpoint", "CK", "--step", "4", "--", "--tasks", "t"],
     {"checkpoint": "CK", "step": 4, "harness": ["--tasks", "t"]}, "lm-eval CHECKPOINT"),
    ("estimate", "--world", ["c.yaml", "--world", "4"], {"world_size": 4}, "--world-size"),
    ("export", "--out", ["CK", "--out", "x"], {"output": "x"}, "-o/--output"),
    ("hf export", "--out", ["CK", "--out", "x"], {"output": "x"}, "-o/--output"),
    ("hf import", "--out", ["HF", "--out", "x"], {"output": "x"}, "-o/--output"),
]  # fmt: skip


def _plugins() -> PluginManager:
    """The installed plugins; llmtrain-lmeval, which only its own nox session installs (it brings
    lm-eval), is registered from its source: its command module imports neither."""
    plugins = PluginManager().load_entry_points()
    if "lm-eval" not in plugins.registry("command"):
        path = ROOT / "plugins" / "llmtrain-lmeval" / "src" / "llmtrain_lmeval" / "plugin.py"
        spec = importlib.util.spec_from_file_location("llmtrain_lmeval_cli_plugin", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        plugins.register(module, "lmeval")
    return plugins


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser(_plugins())


def _commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(`data pack`, its parser), ... for every subcommand with no subcommands of its own."""
    pending = [("", parser)]
    while pending:
        name, current = pending.pop()
        nested = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if name and not nested:
            yield name, current
        for action in nested:
            for sub, sub_parser in action.choices.items():
                pending.append((f"{name} {sub}".strip(), sub_parser))


@pytest.fixture(scope="module")
def commands(parser) -> dict[str, argparse.ArgumentParser]:
    return dict(sorted(_commands(parser)))


def _options(commands) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    for name, parser in commands.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                yield name, parser, action


def _visible(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS


def _shows_a_default(default: object) -> bool:
    return default not in (None, False, "", argparse.SUPPRESS) and default != []


def test_every_command_of_every_package_and_plugin_is_walked(commands, parser):
    installed = set(_plugins().registry("command").names())
    top = {name.split()[0] for name in commands}
    assert installed <= top, installed - top
    assert set(MAIN_OBJECTS) <= set(commands), set(MAIN_OBJECTS) - set(commands)
    for name, sub in commands.items():  # every help renders (a stray % would raise here)
        assert sub.format_help(), name


def test_every_option_has_help_that_shows_its_default(commands):
    no_help, no_default = [], []
    for name, parser, action in _options(commands):
        if not _visible(action):
            continue
        label = f"llmtrain {name} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            no_help.append(label)
        elif _shows_a_default(action.default):
            if "default" not in shown_help(parser, action).lower():
                no_default.append(f"{label} (default {action.default!r})")
    assert not no_help, "options without a help line:\n" + "\n".join(no_help)
    assert not no_default, "help lines that do not show the default:\n" + "\n".join(no_default)


def test_outputs_are_dash_o_and_machine_output_is_json(commands):
    wrong = []
    for name, _, action in _options(commands):
        if not _visible(action):
            continue
        spellings = action.option_strings
        writes = [s for s in spellings if re.fullmatch(r"--(\w+-)*(out|outdir|output)(-\w+)*", s)]
        if (writes or "-o" in spellings) and spellings != ["-o", "--output"]:
            wrong.append(f"llmtrain {name} {'/'.join(spellings)}: spell it -o/--output")
        if "--json" in spellings and (spellings != ["--json"] or action.nargs != 0):
            wrong.append(f"llmtrain {name} --json: a switch, with no other spelling")
        if "-o" in spellings and not OUTPUTS.fullmatch(action.metavar or ""):
            wrong.append(
                f"llmtrain {name} -o {action.metavar or action.dest.upper()}: name what it "
                "writes (DIR, DATASET, FILE or FILE.<suffix>)"
            )
        if "--json" in spellings and not (action.help or "").startswith(JSON_HELP):
            wrong.append(f"llmtrain {name} --json: its help starts {JSON_HELP!r}")
    assert not wrong, "\n".join(wrong)


def test_positionals_are_named_in_capitals(commands):
    wrong = [
        f"llmtrain {name} {action.metavar or action.dest}"
        for name, parser in commands.items()
        for action in parser._actions
        if not action.option_strings
        and not isinstance(action, argparse._SubParsersAction)
        and not str(action.metavar or action.dest).isupper()
    ]
    assert not wrong, "positionals not in capitals:\n" + "\n".join(wrong)


def test_one_concept_one_flag_name(commands):
    wrong = [
        f"llmtrain {name} {spelling}: call it {CONCEPTS[spelling]}"
        for name, _, action in _options(commands)
        if _visible(action)
        for spelling in action.option_strings
        if spelling in CONCEPTS
    ]
    assert not wrong, "\n".join(wrong)


def test_the_main_object_is_positional(commands):
    wrong = []
    for name, expected in MAIN_OBJECTS.items():
        positionals = [
            a
            for a in commands[name]._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        ]
        first = positionals[0] if positionals else None
        if first is None or first.nargs not in (None, "+"):
            wrong.append(f"llmtrain {name}: no required positional main object")
        elif (first.metavar or first.dest) != expected:
            wrong.append(f"llmtrain {name}: the positional is {first.metavar or first.dest}")
    assert not wrong, "\n".join(wrong)


def test_old_spellings_are_hidden_aliases(commands):
    aliases = {
        (name, spelling)
        for name, _, action in _options(commands)
        if isinstance(action, DeprecatedAlias | DeprecatedMainOption)
        for spelling in action.option_strings
    }
    tested = {(name, old) for name, old, *_ in OLD_SPELLINGS}
    assert aliases == tested, f"not aliases: {tested - aliases}; untested: {aliases - tested}"
    for name, spelling in aliases:
        action = commands[name]._option_string_actions[spelling]
        assert action.help is argparse.SUPPRESS, (name, spelling)
        shown = re.search(rf"{re.escape(spelling)}(?![\w-])", commands[name].format_help())
        assert shown is None, (name, spelling)


@pytest.mark.parametrize(
    ("command", "old", "argv", "expected", "new"),
    OLD_SPELLINGS,
    ids=[f"{command} {old}" for command, old, *_ in OLD_SPELLINGS],
)
def test_an_old_spelling_still_works_with_one_line(
    parser, capsys, command, old, argv, expected, new
):
    capsys.readouterr()
    args = _parse(parser, [*command.split(), *argv])
    assert {key: getattr(args, key) for key in expected} == expected
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: llmtrain {command}: ")
    assert f"{old} " in lines[0] and "deprecated" in lines[0] and new in lines[0], lines[0]


def _llmtrain(*argv: object) -> subprocess.CompletedProcess:
    script = [sys.executable, "-c", "import sys; from llmtrain.core_mesh.cli import main; "
              "sys.exit(main())"]  # fmt: skip
    return subprocess.run(
        [*script, *map(str, argv)], capture_output=True, text=True, timeout=300, check=False
    )


def test_old_spellings_end_to_end(tmp_path):
    """The console command with 0.1's spellings: the value reaches the command (its error names
    the checkpoint given), after one deprecation line per old spelling."""
    missing = tmp_path / "runs" / "x" / "checkpoints"
    proc = _llmtrain("export", missing, "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "warning: llmtrain export: --out is deprecated; use -o/--output (the old spelling goes "
        "away after 0.2)",
        f"error: {missing} has no committed checkpoint",
    ]
    proc = _llmtrain("eval", "--checkpoint", missing, "--data", tmp_path / "d.zarr", "--batch", 2)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("warning: llmtrain eval: --checkpoint CHECKPOINT is deprecated;")
    assert lines[1].startswith("warning: llmtrain eval: --batch is deprecated; use --batch-size")
    assert lines[2:] == [f"error: {missing} has no committed checkpoint"]


def test_a_mistyped_command_gets_one_did_you_mean_line():
    proc = _llmtrain("compre", "runs/a")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: llmtrain: 'compre' is not a command; did you mean: compare?\n"
    proc = _llmtrain("data", "pakc", "x.jsonl")
    assert proc.returncode == 2
    assert proc.stderr == "error: llmtrain data: 'pakc' is not a subcommand; did you mean: pack?\n"
