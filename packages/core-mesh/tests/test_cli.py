"""The `llmtrain` command host: plugin subcommands, error reporting, `llmtrain plugins`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.core_mesh import cli
from llmtrain.core_mesh.cli import Command, install_command, main
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import Origin, PluginManager, hookimpl


def _fail_user(args, ctx):
    raise UserError("data/train.jsonl:3: missing field 'text'")


def _fail_bug(args, ctx):
    raise ZeroDivisionError("division by zero")


class Commands:
    @hookimpl
    def llmtrain_commands(self, register):
        noop = lambda parser: None  # noqa: E731
        register("ok", lambda _: Command("succeeds", noop, lambda args, ctx: 0))
        register("user-error", lambda _: Command("fails with bad input", noop, _fail_user))
        register("bug", lambda _: Command("fails with a bug", noop, _fail_bug))

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


def test_a_mistyped_command_gets_the_closest_names_in_one_line(capsys):
    assert main(["user-eror"], plugins=manager()) == 2
    assert capsys.readouterr().err == (
        "error: llmtrain: 'user-eror' is not a command; did you mean: user-error?\n"
    )
    assert main(["nope"], plugins=manager()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: llmtrain: 'nope' is not a command; the commands: ")
    assert "plugins" in err and err.count("\n") == 1
    # a subcommand's own actions too
    assert main(["nested", "iner", "x"], plugins=manager(Subcommands())) == 2
    assert capsys.readouterr().err == (
        "error: llmtrain nested: 'iner' is not a subcommand; did you mean: inner?\n"
    )


def test_an_unknown_flag_of_a_command_is_one_line_pointing_at_its_help(capsys):
    assert main(["plugins", "--bogus", "-x"], plugins=manager()) == 2
    assert capsys.readouterr().err == (
        "error: llmtrain plugins: unrecognized arguments: --bogus -x; see llmtrain plugins --help\n"
    )


def test_console_script_version():
    out = subprocess.run(
        ["llmtrain", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("llmtrain ")


# --- one consistent CLI ---


class Subcommands:
    """Commands with arguments: `train CONFIG [KEY=VALUE ...]` and `nested inner NAME`."""

    @hookimpl
    def llmtrain_commands(self, register):
        def configure_train(parser):
            parser.add_argument("config")
            parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")

        def configure_nested(parser):
            actions = parser.add_subparsers(dest="action", required=True)
            actions.add_parser("inner").add_argument("name")

        def record(args, ctx):
            print(f"debug={ctx.debug} {args}")
            if getattr(args, "config", None) == "bug":
                raise ZeroDivisionError("division by zero")
            return 0

        register("train", lambda _: Command("trains", configure_train, record))
        register("nested", lambda _: Command("has actions", configure_nested, record))


@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "train", "bug"],
        ["train", "--debug", "bug"],
        ["train", "bug", "--debug"],
        ["train", "bug", "a=1", "--debug", "b=2"],
    ],
)
def test_global_flags_work_before_or_after_the_command(argv, capsys):
    assert main(argv, plugins=manager(Subcommands())) == 1
    out, err = capsys.readouterr()
    assert out.startswith("debug=True ") and "debug=True" in out
    assert "Traceback (most recent call last)" in err and "ZeroDivisionError" in err
    if "a=1" in argv:
        assert "overrides=['a=1', 'b=2']" in out


def test_global_flags_reach_nested_actions_and_default_off(capsys):
    pm = manager(Subcommands())
    assert main(["nested", "inner", "x", "--debug"], plugins=pm) == 0
    assert "debug=True" in capsys.readouterr().out
    assert main(["nested", "inner", "x"], plugins=pm) == 0
    out = capsys.readouterr().out
    assert "debug=False" in out and "debug=True" not in out


def test_command_help_lists_the_global_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"], plugins=manager(Subcommands()))
    assert info.value.code == 0
    assert "--debug" in capsys.readouterr().out


def test_overrides_are_optional_the_config_is_what_is_missing(capsys):
    pm = manager(Subcommands())
    assert main(["train"], plugins=pm) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: llmtrain train: the following arguments are required: config; see "
        "llmtrain train --help\n"
    )
    assert main(["train", "cfg.yaml"], plugins=pm) == 0
    assert "overrides=[]" in capsys.readouterr().out


def test_every_known_command_names_its_distribution():
    """The table behind the install hint agrees with the commands installed here."""
    from llmtrain.core_mesh.cli import COMMAND_DISTRIBUTIONS

    pm = PluginManager(blocked=()).load_entry_points()
    ours = [
        entry
        for entry in pm.registry("command").values()
        if (entry.origin.distribution or "").startswith("llmtrain-")
    ]
    assert "plugins" in [entry.name for entry in ours]
    for entry in ours:
        assert COMMAND_DISTRIBUTIONS.get(entry.name) == entry.origin.distribution, entry


def test_a_command_of_a_package_not_installed_says_what_to_install(capsys):
    # a data-only install: no train-loop plugin, so no `run`
    pm = PluginManager(blocked=("train_loop",)).load_entry_points()
    assert "run" not in pm.registry("command")
    assert main(["run", "cfg.yaml", "model.n_layers=2", "--resume"], plugins=pm) == 2
    hint = install_command("llmtrain-train-loop")
    assert capsys.readouterr().err == f"error: `run` is provided by llmtrain-train-loop: {hint}\n"
    assert main(["--debug", "run"], plugins=pm) == 2
    assert hint in capsys.readouterr().err
    assert main(["config", "validate", "cfg.yaml"], plugins=pm) == 2
    assert "`config` is provided by llmtrain-train-loop" in capsys.readouterr().err
    # the commands that are not installed are not offered in the help
    assert main([], plugins=pm) == 2
    assert "    run " not in capsys.readouterr().out


def test_a_command_whose_package_failed_to_load_says_so(capsys):
    class BrokenTrainLoop:
        @hookimpl
        def llmtrain_commands(self, register):
            raise ImportError("libtorch.so: cannot open shared object file")

    pm = PluginManager(blocked=("train_loop",)).load_entry_points()
    pm.register(
        BrokenTrainLoop(),
        "train_loop_broken",
        origin=Origin("train_loop_broken", "llmtrain-train-loop", "0.0"),
    )
    assert main(["run", "cfg.yaml"], plugins=pm) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "error: `run` is provided by llmtrain-train-loop, which is installed but failed to "
        "load; see `llmtrain plugins`\n"
    )


def test_the_missing_command_hint_from_the_console_script(tmp_path):
    env = {**os.environ, "LLMTRAIN_DISABLE_PLUGINS": "train_loop"}
    proc = subprocess.run(
        ["llmtrain", "run", "cfg.yaml"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    # from this checkout, and away from its root: absolute paths, train-loop's last, after
    # those of the llmtrain packages it needs that are not installed here (all of them in
    # core-mesh's own session, none in a venv with everything)
    lead = f"error: `run` is provided by llmtrain-train-loop: {cli._installer()} "
    assert proc.stderr.startswith(lead) and proc.stderr.endswith("\n"), proc.stderr
    named = [Path(word) for word in proc.stderr[len(lead) :].split()]
    assert named[-1] == CHECKOUT / "packages" / "train-loop"
    needed = {"data-pack", "models", "parallel", "checkpoint", "ablate", "downstream"}
    missing = {name for name in needed if not _installed(f"llmtrain-{name}")}
    assert {path.name for path in named[:-1]} == missing
    assert all(path.parent == CHECKOUT / "packages" for path in named)


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# the tests run from a checkout (an editable install, or nox's install from the checkout's path)
CHECKOUT = Path(__file__).resolve().parents[3]


def test_a_checkout_is_found_from_the_installed_core_mesh():
    assert cli.checkout_root() == CHECKOUT


def test_the_install_hint_from_a_checkout_names_paths_that_resolve(monkeypatch, tmp_path):
    """No package index has llmtrain's distributions: from a checkout the hint names the
    package's path and those of the llmtrain packages it needs that are not installed, so that
    pip resolves every one of them."""
    monkeypatch.setattr(cli, "_installer", lambda: "pip install")
    only_core = {"llmtrain-core-mesh"}.__contains__
    monkeypatch.chdir(CHECKOUT)
    assert install_command("llmtrain-data-pack", installed=only_core) == (
        "pip install ./packages/data-pack"
    )
    hint = install_command("llmtrain-train-loop", installed=only_core).split()
    assert hint[:2] == ["pip", "install"] and hint[-1] == "./packages/train-loop"
    assert sorted(hint[2:-1]) == [
        f"./packages/{name}"
        for name in ["ablate", "checkpoint", "data-pack", "downstream", "models", "parallel"]
    ]
    # what is installed is not named again; plugins are found under plugins/
    assert install_command("llmtrain-hf", installed=lambda d: True) == (
        "pip install ./plugins/llmtrain-hf"
    )
    # elsewhere than the checkout's root: absolute paths
    monkeypatch.chdir(tmp_path)
    assert install_command("llmtrain-data-pack", installed=only_core) == (
        f"pip install {CHECKOUT / 'packages' / 'data-pack'}"
    )
    # not from a checkout (a wheel, an index): the distribution's name
    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    assert install_command("llmtrain-data-pack") == "pip install llmtrain-data-pack"


def test_the_install_hint_uses_this_interpreters_installer(monkeypatch):
    python = sys.executable
    bin_dir = Path(python).parent
    monkeypatch.setattr(cli, "_is_installed", lambda name: name == "pip")
    monkeypatch.setattr(cli.shutil, "which", lambda name: str(bin_dir / name))
    assert cli._installer() == "pip install"  # an activated venv with pip
    monkeypatch.setattr(cli.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cli._installer() == f"{python} -m pip install"  # another pip comes first
    monkeypatch.setattr(cli, "_is_installed", lambda name: False)
    assert cli._installer() == f"uv pip install --python {python}"  # a venv uv made


@pytest.mark.parametrize("rank", ["0", "1", "3"])
def test_a_user_error_is_printed_by_rank_0_and_late_by_the_others(rank, monkeypatch, capsys):
    """Rank 0 prints at once. Another rank waits, so that the launcher stops it when rank 0
    exits with the same error (the torchrun test in train-loop shows it); a rank still alive
    after the wait met an error of its own, and prints it with its rank."""
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    monkeypatch.setenv("RANK", rank)
    assert main(["user-error"], plugins=manager()) == 2
    message = "data/train.jsonl:3: missing field 'text'"
    if rank == "0":
        assert (capsys.readouterr().err, waits) == (f"error: {message}\n", [])
    else:
        assert (capsys.readouterr().err, waits) == (
            f"error: rank {rank}: {message}\n",
            [cli.RANK_ERROR_GRACE_S],
        )
    # --debug: every rank at once
    waits.clear()
    assert main(["--debug", "user-error"], plugins=manager()) == 2
    assert message in capsys.readouterr().err and waits == []
