"""A model plugin that is not a Transformer (integration_tests/plugins/llmtrain-toy-lm: causal
convolutions, no KV cache, no packed rows) keeps `LanguageModel`'s contract and so works with
every command: `llmtrain run` trains it (the loss falls, the `downstream` callback scores it),
`generate` decodes greedily by rerunning the prefix, `eval` gives the run's eval loss and
`eval-tasks` the numbers the run logged. (lm-eval: llmtrain-lmeval's tests.)"""

from __future__ import annotations

import json
import math

import pytest
import train_support as ts
from shared_fixtures import run_cli  # noqa: F401
from test_downstream_eval import write_tasks

STEPS = 20
PROMPT = "The cat"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 20-step run of the toy model, with eval and downstream scoring at its last step."""
    tmp = tmp_path_factory.mktemp("toy")
    data = ts.pack_corpus(tmp / "data")
    tasks = write_tasks(tmp)
    config = ts.run_config(data, tmp / "runs", name="toy")
    config["model"] = {"kind": "toy-lm", "max_seq_len": 64, "d_model": 32}
    config["data"]["eval"] |= {"every": STEPS}
    config["training"] |= {"steps": STEPS, "checkpoint_every": STEPS}
    config["callbacks"] = [
        {
            "kind": "downstream",
            "every": STEPS,
            "tasks": [
                {"kind": "hellaswag", "path": tasks["hellaswag"]},
                {"kind": "perplexity", "path": tasks["docs"]},
            ],
        }
    ]
    path = ts.write_config(tmp / "run.yaml", config)
    proc = ts.run(ts.llmtrain("run", path), timeout=600)
    run_dir = tmp / "runs" / "toy"
    return {
        "data": data,
        "tasks": tasks,
        "proc": proc,
        "checkpoints": run_dir / "checkpoints",
        "metrics": ts.by_step(ts.read_metrics(run_dir)),
    }


def test_the_run_trains_the_model(trained):
    assert ts.error_lines(trained["proc"].stderr) == []
    metrics = trained["metrics"]
    first, last = metrics[1]["loss"], metrics[STEPS]["loss"]
    assert first == pytest.approx(math.log(320), abs=0.3)  # a uniform guess over its ids
    assert last < first - 1.0
    assert ts.committed_steps(trained["checkpoints"]) == [STEPS]


def test_generate_decodes_without_a_cache(trained, run_cli):  # noqa: F811
    import torch

    from llmtrain.core_mesh.plugins import PluginManager
    from llmtrain.models.generate import generate
    from llmtrain.train_loop.saved_model import load_model

    argv = ["generate", trained["checkpoints"], "--prompt", PROMPT, "--max-new-tokens", 12]
    code, out, err = run_cli(*argv, "--top-k", 1)
    assert code == 0, err
    model, _, step = load_model(
        str(trained["checkpoints"]), None, PluginManager().load_entry_points()
    )
    assert (type(model).__name__, step, model.new_cache(1, 16)) == ("ToyLM", STEPS, None)
    # greedy decoding is the argmax of a forward pass over the whole prefix, token by token
    prompt = torch.tensor([list(PROMPT.encode())])
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):
            nxt = model(tokens)[:, -1, :258].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(generate(model, prompt, 12, temperature=0, vocab_size=258), tokens)
    new = [t for t in tokens[0, prompt.size(1) :].tolist() if t < 256]
    assert out.rstrip("\n") == PROMPT + bytes(new).decode("utf-8", errors="replace")
    code, sampled, err = run_cli(*argv, "--seed", 3)
    assert code == 0 and sampled.startswith(PROMPT) and sampled == run_cli(*argv, "--seed", 3)[1]


def test_eval_gives_the_runs_eval_loss(trained, run_cli):  # noqa: F811
    code, out, err = run_cli(
        "eval", trained["checkpoints"], "--data", trained["data"].valid, "--batches", 2,
        "--batch-size", 8,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert (result["step"], result["tokens"]) == (STEPS, 2 * 8 * 32)
    assert result["loss"] == pytest.approx(trained["metrics"][STEPS]["eval_loss"], rel=1e-5)


def test_eval_tasks_scores_like_the_run(trained, run_cli, tmp_path):  # noqa: F811
    tasks, out = trained["tasks"], tmp_path / "scores.json"
    code, _, err = run_cli(
        "eval-tasks", trained["checkpoints"],
        "--tasks", f"hellaswag={tasks['hellaswag']},perplexity={tasks['docs']}", "-o", out,
    )  # fmt: skip
    assert code == 0, err
    report, logged = json.loads(out.read_text()), trained["metrics"][STEPS]
    assert report["tasks"]["hellaswag"]["items"] == 13
    for task, key in (("hellaswag", "acc"), ("perplexity", "byte_perplexity")):
        assert report["tasks"][task][key] == pytest.approx(
            logged[f"downstream/{task}/{key}"], rel=1e-5
        ), (task, key)
    # better than a uniform guess over the byte ids: the trained weights were scored
    assert report["tasks"]["perplexity"]["byte_perplexity"] < 256


def test_a_model_without_the_contract_is_refused_with_its_name(trained):
    """A model kind whose module lacks `LanguageModel` (here a bare Linear) is named, not an
    AttributeError deep in generate."""
    import torch
    from llmtrain_toy_lm.options import ToyLMOptions

    from llmtrain.core_mesh.errors import UserError
    from llmtrain.core_mesh.plugins import PluginManager, hookimpl
    from llmtrain.train_loop.saved_model import load_model

    class Bare:
        @hookimpl
        def llmtrain_models(self, register):
            register("toy-lm", lambda options: torch.nn.Linear(2, 2), options=ToyLMOptions)

    plugins = PluginManager(blocked=("toy-lm",)).load_entry_points()
    plugins.register(Bare(), "bare")
    with pytest.raises(UserError, match=r"model kind 'toy-lm' builds a Linear, .*LanguageModel"):
        load_model(str(trained["checkpoints"]), None, plugins)
