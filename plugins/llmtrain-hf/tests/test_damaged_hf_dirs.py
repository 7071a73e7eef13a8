"""Damaged transformers directories, generated: from real `save_pretrained` directories of a small
Llama (one file, and sharded with model.safetensors.index.json) and a GPT-2, every file llmtrain
reads is deleted, cut at random points, its safetensors header bytes flipped, replaced with
garbage, binary or other valid JSON, its tensors given the wrong dtype, shape or name, or its
config changed so that the shapes do not fit. For every case `llmtrain hf import` exits 2 with
one line on stderr that names the file, no traceback, and leaves nothing at the destination; a
sample goes through `llmtrain run` with `init: {from: DIR}` (the `hf` weight format) too. What is
not damage (generation_config.json, which is not read; a missing index beside all its shards; a
directory without tokenizer files; GPT-2 weights saved without the `transformer.` prefix) still
imports to the same weights.

The refusals (marked `damage`) spoil files and read them with llmtrain's own readers: they run
in `nox -s plugin-hf` only, while `plugin-hf-transformers4` still checks that the intact
directories transformers 4.x writes import (`-m "not damage"`)."""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from llmtrain.checkpoint.export import load_model_weights

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
GENERATION = "generation_config.json"
GPT2 = "GPT2LMHeadModel"
DELETE = object()  # a config key to remove
RNG = random.Random(36)  # the cases are generated once, the same on every run


@attrs.frozen
class Case:
    """`damage(dir)` spoils a copy of the `base` directory and returns the file name the error
    must name (None: `names`)."""

    id: str
    base: str  # "llama", "sharded" or "gpt2"
    damage: Callable[[Path], str | None]
    names: str = ""


# --- damage ------------------------------------------------------------------------------------------


def shards(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("model-*.safetensors"))


def pick(file: str) -> Callable[[Path], str]:
    """The file to damage: a name, or `shard<k>` for the k-th shard of a sharded directory."""
    return lambda d: shards(d)[int(file[5:])] if file.startswith("shard") else file


def delete(file: str):
    def damage(d: Path) -> str:
        name = pick(file)(d)
        (d / name).unlink()
        return name

    return damage


def cut(file: str, fraction: float):
    """Keep the first `fraction` of the file (of its text without trailing whitespace, so that
    what is left is never the whole JSON)."""

    def damage(d: Path) -> str:
        name = pick(file)(d)
        data = (d / name).read_bytes()
        size = len(data.rstrip()) if not name.endswith(".safetensors") else len(data)
        (d / name).write_bytes(data[: int(size * fraction)])
        return name

    return damage


def cut_to(file: str, size: int):
    def damage(d: Path) -> str:
        (d / file).write_bytes((d / file).read_bytes()[:size])
        return file

    return damage


def copy_of(other: str) -> Callable[[Path], bytes]:
    """The bytes of another file (relative to the directory) as replacement content."""
    return lambda d: (d / other).read_bytes()


def replace(file: str, content: bytes | Callable[[Path], bytes]):
    def damage(d: Path) -> str:
        name = pick(file)(d)
        (d / name).write_bytes(content(d) if callable(content) else content)
        return name

    return damage


def header_region(data: bytes) -> list[int]:
    """Byte positions of a safetensors file whose change must be refused: the 8-byte header
    length and the header's tensor entries (not the free-form `__metadata__`, whose values no
    reader checks, nor the spaces that pad the header)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length].rstrip(b" ")
    skip = range(0)
    start = header.find(b'"__metadata__"')
    if start >= 0:
        end = header.index(b"}", start) + 1
        if header[end : end + 1] == b",":
            end += 1
        elif header[start - 1 : start] == b",":
            start -= 1
        skip = range(start, end)
    return list(range(8)) + [8 + i for i in range(len(header)) if i not in skip]


def flip(file: str, where: float, mask: int):
    """XOR one byte of the header region (at fraction `where` of it) with `mask`."""

    def damage(d: Path) -> str:
        name = pick(file)(d)
        data = bytearray((d / name).read_bytes())
        region = header_region(bytes(data))
        data[region[int(where * len(region))]] ^= mask
        (d / name).write_bytes(bytes(data))
        return name

    return damage


def edit_config(**values):
    """config.json with `values` set (`DELETE`: the key removed)."""

    def damage(d: Path) -> str:
        config = json.loads((d / CONFIG).read_text())
        config.update(values)
        config = {k: v for k, v in config.items() if v is not DELETE}
        (d / CONFIG).write_text(json.dumps(config))
        return CONFIG

    return damage


def edit_json(file: str, change: Callable[[dict], object]):
    def damage(d: Path) -> str:
        data = json.loads((d / file).read_text())
        (d / file).write_text(json.dumps(change(data)))
        return file

    return damage


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None], file: str = WEIGHTS):
    """Rewrite a safetensors file (as transformers writes it, `format: pt`) after `change`."""

    def damage(d: Path) -> str:
        name = pick(file)(d)
        tensors = dict(load_file(d / name))
        change(tensors)
        save_file(tensors, d / name, metadata={"format": "pt"})
        return name

    return damage


def some_tensor(tensors: dict[str, torch.Tensor], salt: int, dims: int | None = None) -> str:
    names = sorted(k for k, v in tensors.items() if dims is None or v.dim() == dims)
    return names[salt % len(names)]


def retype(dtype: torch.dtype, salt: int):
    def change(tensors):
        name = some_tensor(tensors, salt)
        tensors[name] = tensors[name].to(dtype)

    return change


def drop(salt: int):
    def change(tensors):
        del tensors[some_tensor(tensors, salt)]

    return change


def rename(salt: int):
    def change(tensors):
        name = some_tensor(tensors, salt)
        tensors[name.replace("layers.", "layer.").replace(".h.", ".blocks.") + "_x"] = tensors.pop(
            name
        )

    return change


def add_extra(tensors):
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(4)


def reshape(salt: int):
    def change(tensors):
        name = some_tensor(tensors, salt, dims=2)
        tensors[name] = tensors[name][:-1].contiguous()

    return change


def duplicate_in_shard(d: Path) -> str:
    """A tensor of the first shard written into the second as well."""
    first, second = shards(d)[:2]
    extra = load_file(d / first)
    tensors = {**load_file(d / second), **dict(list(extra.items())[:1])}
    save_file(tensors, d / second, metadata={"format": "pt"})
    return second


def a_directory(file: str):
    def damage(d: Path) -> str:
        name = pick(file)(d)
        (d / name).unlink()
        (d / name).mkdir()
        return name

    return damage


def place(tensor: str, shard: str | int):
    """The index places `tensor` in `shard` (a name, or the k-th shard)."""

    def damage(d: Path) -> str:
        name = shards(d)[shard] if isinstance(shard, int) else shard
        index = json.loads((d / INDEX).read_text())
        index["weight_map"][tensor] = name
        (d / INDEX).write_text(json.dumps(index))
        return INDEX

    return damage


def weight_map_as_list(index: dict) -> dict:
    return {**index, "weight_map": list(index["weight_map"])}


GARBAGE = b"<html>404 Not Found</html>"


def binary(n: int) -> bytes:
    return bytes(RNG.randrange(256) for _ in range(n))


def cases() -> list[Case]:
    out: list[Case] = []
    add = out.append
    # deleted (tokenizer files, the index and generation_config.json may be absent: not damage)
    add(Case("delete-config", "llama", delete(CONFIG)))
    add(Case("delete-weights", "llama", delete(WEIGHTS), names=".safetensors"))
    for k in range(3):
        add(Case(f"delete-shard{k}", "sharded", delete(f"shard{k}")))
    # cut at random points
    for file, base, n in (
        (CONFIG, "llama", 6),
        (WEIGHTS, "llama", 10),
        (TOKENIZER, "llama", 4),
        (TOKENIZER_CONFIG, "llama", 3),
        (INDEX, "sharded", 4),
        ("shard1", "sharded", 4),
        (CONFIG, "gpt2", 3),
        (WEIGHTS, "gpt2", 4),
    ):
        for fraction in [0.0, *sorted(RNG.uniform(0.001, 1.0) for _ in range(n - 1))]:
            add(Case(f"cut-{base}-{file}-{fraction:.4f}", base, cut(file, fraction)))
    for size in (8, 20):  # shorter than the header length, and than a header
        add(Case(f"cut-weights-to-{size}-bytes", "llama", cut_to(WEIGHTS, size)))
    # one flipped byte in a safetensors header
    for file, base, n in ((WEIGHTS, "llama", 24), (WEIGHTS, "gpt2", 8), ("shard2", "sharded", 8)):
        for _ in range(n):
            where, mask = RNG.random(), RNG.randrange(1, 256)
            add(Case(f"flip-{base}-{file}-{where:.4f}-x{mask:02x}", base, flip(file, where, mask)))
    # replaced: garbage, binary, empty, other valid JSON, another model's weights
    other_json = {
        "list": b"[1, 2]",
        "string": b'"config"',
        "null": b"null",
        "empty-object": b"{}",
    }
    for file, base in (
        (CONFIG, "llama"),
        (WEIGHTS, "llama"),
        (TOKENIZER, "llama"),
        (TOKENIZER_CONFIG, "llama"),
        (INDEX, "sharded"),
        ("shard0", "sharded"),
    ):
        add(Case(f"garbage-{file}", base, replace(file, GARBAGE)))
        add(Case(f"binary-{file}", base, replace(file, binary(300))))
        add(Case(f"empty-{file}", base, replace(file, b"")))
        for kind, text in other_json.items():
            if file == TOKENIZER_CONFIG and kind == "empty-object":
                continue  # an object without eos_token: the end of document is found elsewhere
            add(Case(f"{kind}-{file}", base, replace(file, text)))
    add(Case("config-is-tokenizer-config", "llama", replace(CONFIG, copy_of(TOKENIZER_CONFIG))))
    add(Case("config-is-generation-config", "llama", replace(CONFIG, copy_of(GENERATION))))
    add(Case("tokenizer-is-config", "llama", replace(TOKENIZER, copy_of(CONFIG))))
    add(Case("index-is-config", "sharded", replace(INDEX, copy_of(CONFIG))))
    add(Case("weights-of-gpt2-in-llama", "llama", replace(WEIGHTS, copy_of(f"../gpt2/{WEIGHTS}"))))
    # architectures llmtrain does not map, quantized models, odd config values
    add(
        Case(
            "falcon", "llama", edit_config(model_type="falcon", architectures=["FalconForCausalLM"])
        )
    )
    add(Case("gemma", "llama", edit_config(model_type="gemma", architectures=["GemmaForCausalLM"])))
    add(Case("unknown-model-type", "llama", edit_config(model_type="no-such-model")))
    add(Case("no-model-type", "llama", edit_config(model_type=DELETE)))
    add(Case("gpt2-model-type", "llama", edit_config(model_type="gpt2", architectures=[GPT2])))
    add(Case("architectures-a-string", "llama", edit_config(architectures="LlamaForCausalLM")))
    add(Case("gptq", "llama", edit_config(quantization_config={"quant_method": "gptq", "bits": 4})))
    add(Case("gelu-llama", "llama", edit_config(hidden_act="gelu")))
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 50000.0}
    add(Case("yarn", "llama", edit_config(rope_parameters=yarn, rope_scaling=yarn)))
    add(Case("dtype-unknown", "llama", edit_config(dtype="float99")))
    add(Case("gpt2-relu", "gpt2", edit_config(activation_function="relu")))
    add(Case("gpt2-layer-scaling", "gpt2", edit_config(scale_attn_by_inverse_layer_idx=True)))
    for field in ("hidden_size", "num_hidden_layers", "vocab_size"):
        for bad in ("64", None, [64], -3, 0, 64.5):
            add(Case(f"{field}={bad!r}", "llama", edit_config(**{field: bad})))
    for bad in ("small", None, [1e-6], {"eps": 1e-6}):
        add(Case(f"rms_norm_eps={bad!r}", "llama", edit_config(rms_norm_eps=bad)))
    # config values whose shapes the weights do not have
    shaped = {
        "llama": {
            "hidden_size": [32, 128],
            "intermediate_size": [64, 128],
            "num_hidden_layers": [1, 3],
            "num_key_value_heads": [1, 4],
            "head_dim": [8, 32],
            "vocab_size": [256, 301],
            "tie_word_embeddings": [True],
            "attention_bias": [True],
            "mlp_bias": [True],
        },
        "gpt2": {
            "n_embd": [32, 128],
            "n_inner": [128],
            "n_layer": [1, 3],
            "n_positions": [64, 256],
            "vocab_size": [299],
            "tie_word_embeddings": [False],  # saved tied: no lm_head.weight
        },
    }
    for base, fields in shaped.items():
        for field, values in fields.items():
            for value in values:
                change = edit_config(**{field: value})
                add(Case(f"{base}-{field}={value}", base, change, names=CONFIG))
    add(Case("sharded-num_hidden_layers=3", "sharded", edit_config(num_hidden_layers=3)))
    # tensors of the wrong dtype, shape or name; missing, extra, in two shards
    for s in sorted(RNG.sample(range(1000), 3)):
        add(Case(f"int32-tensor-{s}", "llama", edit_tensors(retype(torch.int32, s))))
        add(Case(f"int8-tensor-{s}", "llama", edit_tensors(retype(torch.int8, s))))
        add(Case(f"missing-tensor-{s}", "llama", edit_tensors(drop(s))))
        add(Case(f"renamed-tensor-{s}", "llama", edit_tensors(rename(s))))
        add(Case(f"reshaped-tensor-{s}", "llama", edit_tensors(reshape(s))))
        add(Case(f"gpt2-missing-tensor-{s}", "gpt2", edit_tensors(drop(s))))
        add(Case(f"gpt2-reshaped-tensor-{s}", "gpt2", edit_tensors(reshape(s))))
    add(Case("float8-tensor", "llama", edit_tensors(retype(torch.float8_e4m3fn, 0))))
    add(Case("extra-tensor", "llama", edit_tensors(add_extra)))
    add(Case("shard-missing-tensor", "sharded", edit_tensors(drop(1), "shard3")))
    add(Case("tensor-in-two-shards", "sharded", duplicate_in_shard))
    missing = "model-00009-of-00009.safetensors"
    add(Case("index-names-missing-shard", "sharded", place("lm_head.weight", missing), missing))
    add(Case("index-names-outside", "sharded", place("lm_head.weight", "../model.safetensors")))
    add(Case("index-names-missing-tensor", "sharded", place("model.layers.0.gone.weight", 0)))
    add(Case("index-weight-map-list", "sharded", edit_json(INDEX, weight_map_as_list)))
    add(Case("config-a-directory", "llama", a_directory(CONFIG)))
    add(Case("shard-a-directory", "sharded", a_directory("shard1")))
    assert len({c.id for c in out}) == len(out), sorted(c.id for c in out)
    return out


CASES = cases()


# --- directories -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory, hf, tokenizer_json) -> Path:
    """One real directory per base (`save_pretrained`), built once for the module."""
    root = tmp_path_factory.mktemp("bases")
    llama = hf.random_model(hf.llama_config())
    hf.save_dir(llama, root / "llama", tokenizer_json)
    llama.save_pretrained(root / "sharded", max_shard_size="100KB")
    hf.save_dir(hf.random_model(hf.gpt2_config()), root / "gpt2")
    assert len(shards(root / "sharded")) >= 4 and (root / "sharded" / INDEX).exists()
    return root


def damaged(bases: Path, tmp_path: Path, case: Case) -> tuple[Path, str]:
    """A copy of the case's base (beside links to the other bases) with its damage done."""
    work = tmp_path / "dirs"
    work.mkdir()
    for base in ("llama", "sharded", "gpt2"):
        if base != case.base:
            (work / base).symlink_to(bases / base)
    target = work / case.base
    shutil.copytree(bases / case.base, target)
    named = case.damage(target)
    return target, case.names or named


def assert_refused(code: int, err: str, names: str, *, lines: int | None = 1) -> str:
    """Exit 2, one error line (and only it, for `lines=1`) naming `names`, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    if lines is not None:
        assert len(err.splitlines()) == lines, err
    assert names in errors[0], errors[0]
    return errors[0]


@pytest.mark.damage
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_import_of_a_damaged_directory_is_refused_by_name(run_cli, bases, tmp_path, case):
    hf_dir, names = damaged(bases, tmp_path, case)
    out = tmp_path / "imported"
    code, stdout, err = run_cli("hf", "import", hf_dir, "-o", out)
    assert_refused(code, err, names)
    assert stdout == ""
    assert not out.exists()  # not even an empty directory: nothing that looks like a checkpoint


def test_there_are_enough_cases():
    assert len(CASES) >= 200
    assert {c.base for c in CASES} == {"llama", "sharded", "gpt2"}


# every 6th case through a run; tokenizer files are not read by a warm start
RUN_CASES = [c for c in CASES if "tokenizer" not in c.id][::6]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_json) -> str:
    from llmtrain.data_pack.pack import pack
    from llmtrain.train_loop.experiments.quickstart import write_corpus

    root = tmp_path_factory.mktemp("data")
    write_corpus(root / "train.jsonl", 20, seed=0)
    (root / "tokenizer.json").write_text(tokenizer_json)
    out = str(root / "train.zarr")
    tokenizer = {"kind": "hf", "path": str(root / "tokenizer.json")}
    pack([str(root / "train.jsonl")], out, tokenizer, workers=1, overwrite=True)
    return out


def run_config(tmp_path: Path, data: str, hf_dir: Path) -> Path:
    config = {
        "name": "ft",
        "run_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "data": {"train": [{"path": data}], "seq_len": 32, "micro_batch": 2},
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "training": {"steps": 1, "log_every": 1},
        "loggers": [{"kind": "jsonl"}],
        "init": {"from": str(hf_dir), "format": "hf"},
    }
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.damage
@pytest.mark.parametrize("case", RUN_CASES, ids=[c.id for c in RUN_CASES])
def test_a_run_from_a_damaged_directory_is_refused_by_name(run_cli, bases, data, tmp_path, case):
    """No `model:` section: the model comes from config.json (`model: {from: DIR}` expanded
    when the config loads), which checks the weight files' headers too."""
    hf_dir, names = damaged(bases, tmp_path, case)
    code, _, err = run_cli("run", run_config(tmp_path, data, hf_dir))
    assert_refused(code, err, names)  # when the config loads: before the run starts
    assert not (tmp_path / "runs").exists()


# the llama base as a hand-written model section (no `model: {from: ...}` to check the headers)
LLAMA_MODEL = {
    "kind": "tiny",
    "vocab_size": 300,
    "pad_vocab_to": 1,
    "max_seq_len": 64,
    "mlp_hidden": 96,
    "rope_base": 50000.0,
    "norm_eps": 1e-6,
    "tied_embeddings": False,
}
WARM_START_CASES = {
    # the headers fit; only the tensors show the stored head is not the embedding
    "tied-head-differs": (edit_config(tie_word_embeddings=True), None),
    "cut-weights": (cut(WEIGHTS, 0.5), LLAMA_MODEL),
    "flipped-header": (flip(WEIGHTS, 0.3, 0x11), LLAMA_MODEL),
    "int8-tensor": (edit_tensors(retype(torch.int8, 3)), LLAMA_MODEL),
}


@pytest.mark.damage
@pytest.mark.parametrize("name", sorted(WARM_START_CASES))
def test_a_damage_found_at_the_warm_start_ends_the_run_with_its_line(
    run_cli, bases, data, tmp_path, name
):
    """What only the warm start reads (the tensors, or every file when the model section is
    written out) fails there: the run's log lines, then the one error line, no checkpoint."""
    damage, model = WARM_START_CASES[name]
    hf_dir, names = damaged(bases, tmp_path, Case(name, "llama", damage))
    path = run_config(tmp_path, data, hf_dir)
    if model is not None:
        config = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**config, "model": model}))
    code, _, err = run_cli("run", path)
    line = assert_refused(code, err, names, lines=None)
    assert err.rstrip("\n").splitlines()[-1] == line and "run.start" in err
    assert not list((tmp_path / "runs").glob("ft/checkpoints/step-*"))


def test_the_sample_of_runs_covers_every_base():
    assert len(RUN_CASES) >= 30 and {c.base for c in RUN_CASES} == {"llama", "sharded", "gpt2"}


# --- what is not damage ------------------------------------------------------------------------------


def strip_prefix(d: Path) -> None:
    """GPT-2 weights as the original checkpoints hold them: `h.0...`, `wte.weight`."""
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(d / WEIGHTS).items()}
    save_file(tensors, d / WEIGHTS, metadata={"format": "pt"})


READABLE = {
    "generation-config-garbage": ("llama", replace(GENERATION, GARBAGE)),
    "generation-config-binary": ("llama", replace(GENERATION, binary(100))),
    "generation-config-deleted": ("llama", delete(GENERATION)),
    "index-deleted-shards-present": ("sharded", delete(INDEX)),
    "tokenizer-files-deleted": (
        "llama",
        lambda d: [delete(TOKENIZER)(d), delete(TOKENIZER_CONFIG)(d)],
    ),
    "gpt2-without-prefix": ("gpt2", strip_prefix),
}


@pytest.mark.parametrize("name", sorted(READABLE))
def test_what_llmtrain_does_not_read_or_can_do_without_still_imports(
    run_cli, bases, tmp_path, name
):
    """The same weights as the undamaged directory: the cases above fail for their damage."""
    base, change = READABLE[name]
    reference = tmp_path / "reference"
    code, _, err = run_cli("hf", "import", bases / base, "-o", reference)
    assert code == 0, err
    hf_dir = tmp_path / base
    shutil.copytree(bases / base, hf_dir)
    change(hf_dir)
    code, _, err = run_cli("hf", "import", hf_dir, "-o", tmp_path / "imported")
    assert code == 0, err
    ours, _, _ = load_model_weights(str(tmp_path / "imported"))
    theirs, _, _ = load_model_weights(str(reference))
    assert sorted(ours) == sorted(theirs)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


# --- export to a bad destination ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(bases, tmp_path_factory) -> Path:
    from llmtrain_hf.transfer import import_hf

    out = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    import_hf(str(bases / "llama"), str(out))
    return out


@pytest.mark.damage
def test_bad_destinations_are_refused_and_nothing_is_written(run_cli, bases, checkpoint, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    code, _, err = run_cli("hf", "export", checkpoint, "-o", tmp_path / "file")
    assert_refused(code, err, "file is a file; give a directory for the transformers model")
    code, _, err = run_cli("hf", "export", checkpoint, "-o", tmp_path / "file" / "model")
    assert_refused(code, err, f"cannot create {tmp_path / 'file' / 'model'}")

    code, _, err = run_cli("hf", "import", bases / "llama", "-o", tmp_path / "file")
    assert_refused(code, err, "file is a file; give a directory for the checkpoint")
    code, _, err = run_cli("hf", "import", bases / "llama", "-o", tmp_path / "file" / "c")
    assert_refused(code, err, f"{tmp_path / 'file'} is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no partial export left
    assert (tmp_path / "file").read_text() == "not a directory"


# --- through fsspec: a remote directory's headers are parsed by llmtrain ---------------------------

REMOTE_CASES = [c for c in CASES if c.base == "llama" and WEIGHTS in c.id and "-tensor" not in c.id]


def upload(local: Path, url: str) -> str:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.rm(url, recursive=True) if fs.exists(url) else None
    for path in local.iterdir():
        fs.pipe(f"{url}/{path.name}", path.read_bytes())
    return url


@pytest.mark.damage
@pytest.mark.parametrize("case", REMOTE_CASES, ids=[c.id for c in REMOTE_CASES])
def test_a_damaged_remote_directory_is_refused_by_name(bases, tmp_path, case):
    """`memory://` stands for object storage: the format reads it through fsspec, not mmap."""
    from llmtrain_hf.weights import HFWeights

    from llmtrain.core_mesh.errors import UserError

    hf_dir, names = damaged(bases, tmp_path, case)
    url = upload(hf_dir, f"memory://damaged/{tmp_path.name}")
    for read in (HFWeights().model, HFWeights().load):
        with pytest.raises(UserError) as refused:
            read(url, {})
        assert names in str(refused.value) and "\n" not in str(refused.value)


def test_a_remote_directory_reads_as_the_local_one(bases):
    from llmtrain_hf.weights import HFWeights

    url = upload(bases / "llama", "memory://intact/llama")
    remote, remote_model = HFWeights().load(url, {})
    local, local_model = HFWeights().load(str(bases / "llama"), {})
    assert remote_model == local_model == HFWeights().model(url, {})
    assert sorted(remote) == sorted(local)
    assert all(torch.equal(remote[k], local[k]) for k in local)


def test_there_are_enough_remote_cases():
    assert len(REMOTE_CASES) >= 30
