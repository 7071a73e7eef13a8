"""The `llmtrain` command host: plugin subcommands, error reporting, `llmtrain plugins`."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from llmtrain.core_mesh.cli import Command, main
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager, hookimpl


def _fail_user(args, ctx):
    raise UserError("data/train.jsonl:3: missing field 'text'")


def _fail_bug(args, ctx):
    raise ZeroDivisionError("division by zero")


class Commands:
    @hookimpl
    def llmtrain_commands(self, register):
        noop = lambda parser: None  # noqa: E731
        register("ok", Command("succeeds", noop, lambda args, ctx: 0))
        register("user-error", Command("fails with bad input", noop, _fail_user))
        register("bug", Command("fails with a bug", noop, _fail_bug))

    @hookimpl
    def llmtrain_models(self, register):
        register("gpt", object())


class Broken:
    @hookimpl
    def llmtrain_models(self, register):
        raise ImportError("no module named 'flash_attn'")


def manager(*extra):
    pm = PluginManager(blocked=()).load_entry_points()
    pm.register(Commands(), "test-commands")
    for i, plugin in enumerate(extra):
        pm.register(plugin, f"extra{i}")
    return pm


def test_success_and_help(capsys):
    assert main(["ok"], plugins=manager()) == 0
    assert main([], plugins=manager()) == 2
    assert "user-error" in capsys.readouterr().out


def test_user_error_is_one_message_without_traceback(capsys):
    assert main(["user-error"], plugins=manager()) == 2
    err = capsys.readouterr().err
    assert err == "error: data/train.jsonl:3: missing field 'text'\n"


def test_bug_is_brief_unless_debug(capsys):
    assert main(["bug"], plugins=manager()) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError: division by zero" in err and "--debug" in err
    assert "Traceback" not in err
    assert main(["--debug", "bug"], plugins=manager()) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_broken_plugin_warns_but_does_not_break_other_commands(capsys):
    assert main(["ok"], plugins=manager(Broken())) == 0
    assert "1 plugin problem; see `llmtrain plugins`" in capsys.readouterr().err


def test_plugins_table_json_and_check(capsys):
    pm = manager(Broken())
    assert main(["plugins"], plugins=pm) == 0
    out = capsys.readouterr().out
    assert re.search(r"^model +gpt +test-commands", out, re.M)
    assert "broken (1):" in out and "ImportError: no module named 'flash_attn'" in out
    assert main(["plugins", "--check"], plugins=pm) == 1
    capsys.readouterr()
    assert main(["plugins", "--json"], plugins=pm) == 0
    report = json.loads(capsys.readouterr().out)
    assert {
        "kind": "command",
        "name": "plugins",
        "plugin": "core",
        "package": "llmtrain-core-mesh",
    }.items() <= report["entries"][[e["name"] for e in report["entries"]].index("plugins")].items()
    assert report["problems"][0]["plugin"] == "extra0"


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["nope"], plugins=manager())
    assert info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_console_script_version():
    out = subprocess.run(
        ["llmtrain", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("llmtrain ")
