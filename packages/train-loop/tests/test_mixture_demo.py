"""`llmtrain quickstart --mixture`: three domains of llmtrain's own making, packed with a held-out
part each, and a base config that `config validate` accepts and whose printed next steps are
the mixture recipe's commands."""

from __future__ import annotations

import ast
import json
import random

import yaml

from llmtrain.data_pack.store import PackedDataset
from llmtrain.train_loop.experiments import mixture_demo


def test_the_domains_are_what_they_say():
    rng = random.Random(0)
    for _ in range(20):
        (function,) = ast.parse(mixture_demo.code(rng)).body  # one function, valid Python
        assert isinstance(function, ast.FunctionDef)
        assert isinstance(function.body[-1], ast.Return)
        noise = mixture_demo.noise(rng)
        assert set(noise) <= set(mixture_demo.NOISE_ALPHABET)
    assert len(set(mixture_demo.NOISE_ALPHABET)) == 64  # 6 bits a character
    rng = random.Random(1)
    text = "".join(mixture_demo.noise(rng) for _ in range(200))
    counts = [text.count(c) for c in mixture_demo.NOISE_ALPHABET]
    assert max(counts) < 1.5 * len(text) / 64  # uniform: nothing to learn but the alphabet


def test_quickstart_mixture_packs_the_domains_and_writes_a_valid_base(run_cli, tmp_path):
    work = tmp_path / "mix"
    code, out, said = run_cli("quickstart", "--mixture", "--dir", work, "--documents", 60)
    assert code == 0, said
    assert out == ""  # the commands go to stderr, as the quickstart's do
    for domain in mixture_demo.DOMAINS:
        for split in ("", "-valid"):
            packed = PackedDataset(str(work / f"{domain}{split}.zarr"))
            texts = [
                json.loads(line)["text"]
                for line in (work / f"{domain}{split}.jsonl").read_text().splitlines()
            ]
            assert packed.n_documents == len(texts) == (60 if split == "" else 40)
            assert packed.n_bytes == sum(len(t.encode()) for t in texts)
    config = yaml.safe_load((work / "mixture.yaml").read_text())
    assert [d["name"] for d in config["data"]["train"]] == list(mixture_demo.DOMAINS)
    assert [e["name"] for e in config["data"]["eval"]] == list(mixture_demo.DOMAINS)
    assert config["training"]["steps"] == mixture_demo.STEPS
    code, _, err = run_cli("config", "validate", work / "mixture.yaml")
    assert code == 0, err
    assert f"--mixtures 16 --dir {work / 'sweeps'} --name swarm" in said
    assert f"--mixture --target '{mixture_demo.TARGET}'" in said
