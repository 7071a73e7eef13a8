"""How lm-eval finds the `llmtrain` model: the installed startup hook, in fresh interpreters
(cheap: lm-eval's registry loads, the model class does not; test_parity runs the `lm_eval`
command itself), and the `llmtrain lm-eval` command's harness command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

STARTED = """
import sys
assert "llmtrain_lmeval" in sys.modules, "the .pth startup hook did not run"
assert not {"lm_eval", "torch"} & set(sys.modules), "the startup hook imported too much"
"""
REGISTERED = """
import sys
from lm_eval.api import registry
assert len(registry.model_registry) == 0  # lm-eval fills it from lm_eval.models, lazily
import lm_eval.models
names = dict(registry.model_registry.items())
assert names["llmtrain"] == "llmtrain_lmeval.model:LLMTrainLM", names.get("llmtrain")
assert names["hf"] == "lm_eval.models.huggingface:HFLM"  # the built-in models are all there
assert "torch" not in sys.modules  # the placeholder is lazy
print("ok")
"""


def python(code: str, *flags: str) -> str:
    proc = subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_fresh_interpreter_knows_the_model_once_lm_eval_loads_its_models():
    assert python(STARTED + REGISTERED) == "ok"


def test_without_the_startup_hook_importing_the_package_registers_it():
    """`python -S` reads no .pth file: `import llmtrain_lmeval` is the Python API's way."""
    from pathlib import Path

    import llmtrain_lmeval
    import lm_eval

    paths = [str(Path(m.__file__).parents[1]) for m in (llmtrain_lmeval, lm_eval)]
    code = f"import sys; sys.path[:0] = {paths!r}\n"
    assert python(code + "import sys; assert 'llmtrain_lmeval' not in sys.modules", "-S") == ""
    assert python(code + "import llmtrain_lmeval\n" + REGISTERED, "-S") == "ok"


def test_registering_twice_or_after_lm_eval_loaded_is_harmless():
    import llmtrain_lmeval
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import get_model, model_registry

    llmtrain_lmeval.watch()
    llmtrain_lmeval.register()
    model = get_model("llmtrain")  # materialised: the class replaces the placeholder
    llmtrain_lmeval.register()
    assert model_registry.get("llmtrain") is model
    assert model.__module__ == "llmtrain_lmeval.model"


def test_llmtrain_lm_eval_command_line(capsys):
    from llmtrain_lmeval.plugin import configure, harness_argv

    from llmtrain.core_mesh.cli_conventions import ConventionParser
    from llmtrain.core_mesh.errors import UserError

    parser = ConventionParser(prog="llmtrain lm-eval")
    configure(parser)
    args = parser.parse_args(
        ["runs/x/checkpoints", "--step", "40", "--model-args", "max_length=512",
         "--", "--tasks", "hellaswag", "--batch_size", "32"]
    )  # fmt: skip
    assert harness_argv(args)[1:] == [
        "-m", "lm_eval", "run", "--model", "llmtrain",
        "--model_args", "checkpoint=runs/x/checkpoints,step=40,max_length=512",
        "--tasks", "hellaswag", "--batch_size", "32",
    ]  # fmt: skip
    # 0.1's spelling, for one more release
    old = parser.parse_args(["--checkpoint", "runs/x/checkpoints", "--step", "40", "--model-args",
                             "max_length=512", "--", "--tasks", "hellaswag", "--batch_size", "32"])  # fmt: skip
    assert harness_argv(old) == harness_argv(args)
    assert "--checkpoint CHECKPOINT is deprecated; use llmtrain lm-eval CHECKPOINT" in (
        capsys.readouterr().err
    )
    args = parser.parse_args(["c", "--", "--tasks", "t", "--model", "hf"])
    with pytest.raises(UserError, match="leave out --model"):
        harness_argv(args)
    with pytest.raises(UserError, match="after --, at least --tasks"):
        harness_argv(parser.parse_args(["c"]))
