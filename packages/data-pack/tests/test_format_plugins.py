"""Input formats are plugins of kind `data_format`: data-pack's own come through the registry,
`--input-format` and its error come from it, README's table of formats is held to it, and a third
party's format (a module of its own, registered in process as its entry point would be) packs
through spawned workers exactly as the same documents given as JSONL; a plugin that builds
something else is refused naming it."""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog

from llmtrain.core_mesh.cli import main
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import DATA_FORMAT, PluginManager, hookimpl
from llmtrain.data_pack.formats import AUTO, InputFormat, InputFormats
from llmtrain.data_pack.pack import pack
from llmtrain.data_pack.store import PackedDataset

README = Path(__file__).parents[1] / "README.md"
BYTES = {"kind": "bytes"}

# a third party's plugin module: documents are paragraphs (separated by blank lines) of .para
# files, each numbered by its first line; one task a file
PARAGRAPHS = """
import attrs
import fsspec

from llmtrain.core_mesh.plugins import hookimpl
from llmtrain.data_pack.documents import Documents
from llmtrain.data_pack.formats import InputFormat
from llmtrain.data_pack.sources import Task


@attrs.frozen
class ParagraphFormat(InputFormat):
    name = "paragraphs"
    suffixes = (".para",)
    fields = False

    def plan(self, source, number, split_bytes, storage_options):
        yield Task(
            source=number, url=source.url, format=self, first_line=1, input_bytes=source.size
        )

    def read(self, task, selection, storage_options, limit_rows):
        with fsspec.open(task.url, "rb", **(storage_options or {})) as f:
            data = f.read()
        lines = data.decode("utf-8").split("\\n")
        docs = Documents(n_lines=len(lines), text_bytes=len(data))
        start = None
        for number, line in enumerate([*lines, ""]):
            if line.strip() and start is None:
                start = number
            elif not line.strip() and start is not None:
                docs.add("\\n".join(lines[start:number]), start, task.source, "")
                start = None
        return docs


@hookimpl
def llmtrain_data_formats(register):
    register("paragraphs", lambda options: ParagraphFormat(), help="blank-line paragraphs")
"""


@pytest.fixture
def installed() -> PluginManager:
    return PluginManager().load_entry_points()


@pytest.fixture
def cli(capsys):
    """cli(plugins, *argv) -> (exit code, stdout, stderr) of `llmtrain ...` with those plugins;
    the logging it sets up is undone after the test (as `run_cli` does)."""

    def run(plugins: PluginManager, *argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv], plugins=plugins)
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_llmtrain", False)]:
        root.removeHandler(handler)
        handler.close()
    structlog.reset_defaults()


@pytest.fixture
def with_paragraphs(tmp_path, monkeypatch, installed) -> PluginManager:
    """The installed plugins and the paragraphs plugin, whose module the spawned workers import
    (they start with this process's sys.path) to unpickle its tasks."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "llmtrain_paragraphs.py").write_text(PARAGRAPHS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    installed.register(importlib.import_module("llmtrain_paragraphs"), "paragraphs")
    yield installed
    sys.modules.pop("llmtrain_paragraphs", None)


def _texts(path) -> list[str]:
    ds = PackedDataset(str(path))
    tokens, offsets = ds.read(0, ds.n_tokens), ds.doc_offsets[:].tolist()
    return [
        tokens[a : b - 1].astype(np.uint8).tobytes().decode()
        for a, b in itertools.pairwise(offsets)
    ]


def test_data_packs_formats_are_entries_of_the_registry(installed):
    registry = installed.registry(DATA_FORMAT)
    ours = {e.name for e in registry.values() if e.origin.distribution == "llmtrain-data-pack"}
    assert {"jsonl", "text", "text-lines", "parquet", "arrow"} <= ours
    formats = InputFormats.from_plugins(installed)
    assert sorted(formats) == registry.names()
    assert all(isinstance(formats[name], InputFormat) for name in formats)
    # by suffix, under compression suffixes, in any case; JSONL for a suffix no format claims
    assert formats.for_file("s3://b/x.jsonl.zst").name == "jsonl"
    assert formats.for_file("/data/Book.TXT.gz").name == "text"
    assert formats.for_file("a/part-0.parquet").name == "parquet"
    assert formats.for_file("a/shard.bin").name == "jsonl"
    assert formats.for_file("a/shard.bin", "text").name == "text"
    assert formats.one_per_line(formats["text"]).name == "text-lines"
    assert formats.one_per_line(formats["jsonl"]).name == "jsonl"
    assert formats.claims("d/x.ndjson") and not formats.claims("d/_SUCCESS")
    assert not formats.claims("d/.x.parquet") and not formats.claims("d/notes.md")


def test_an_unknown_input_format_lists_the_registered_ones(tmp_path, installed, cli):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    choices = ", ".join([AUTO, *installed.registry(DATA_FORMAT).names()])
    for given, hint in (("xml", ""), ("parqet", " (did you mean 'parquet'?)")):
        argv = ["data", "pack", tmp_path / "a.jsonl", "-o", tmp_path / "out", "--tokenizer"]
        code, _, err = cli(installed, *argv, "bytes", "--input-format", given)
        assert code == 2
        assert err == (
            f"error: unknown input format {given!r}{hint}; choose one of {choices} "
            "(`llmtrain plugins` lists the data_format plugins that add them)\n"
        )
    assert not (tmp_path / "out").exists()


def test_readmes_table_of_formats_is_the_registry(installed):
    """The docs' list of formats is held to the registry: every format data-pack registers has
    a row naming its suffixes, and every row is a registered format."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Inputs\n(.*?)(?=^#)", text, re.M | re.S)
    assert section, "README has no '## Inputs' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")][2:]
    documented = {}
    for row in rows:
        name, suffixes = (cell.strip() for cell in row.strip("|").split("|")[:2])
        documented[name.strip("`")] = {s for s in re.findall(r"`([^`]+)`", suffixes) if s[0] == "."}
    formats = InputFormats.from_plugins(installed)
    ours = {
        e.name: set(formats[e.name].suffixes)
        for e in installed.registry(DATA_FORMAT).values()
        if e.origin.distribution == "llmtrain-data-pack"
    }
    assert documented == ours


def test_a_third_partys_format_packs_as_jsonl_would(tmp_path, with_paragraphs, cli):
    paragraphs = [["first one", "two lines\nof it"], ["naïve café", "日本語 😀", "last"]]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k, docs in enumerate(paragraphs):
        (folder / f"{k}.para").write_text("\n\n\n".join(docs) + "\n", encoding="utf-8")
    jsonl = tmp_path / "same.jsonl"
    flat = [d for docs in paragraphs for d in docs]
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in flat), encoding="utf-8")

    summary = pack([str(folder)], str(tmp_path / "para"), BYTES, workers=2, plugins=with_paragraphs)
    pack([str(jsonl)], str(tmp_path / "ref"), BYTES, workers=1, plugins=with_paragraphs)
    assert summary.documents == len(flat)
    para, ref = PackedDataset(str(tmp_path / "para")), PackedDataset(str(tmp_path / "ref"))
    np.testing.assert_array_equal(para.read(0, para.n_tokens), ref.read(0, ref.n_tokens))
    np.testing.assert_array_equal(para.doc_offsets[:], ref.doc_offsets[:])
    assert _texts(tmp_path / "para") == flat
    assert para.n_bytes == ref.n_bytes == sum(len(d.encode()) for d in flat)  # whatever the format
    # each paragraph named by its file and first line (1-based)
    origins = para.origins(0, para.n_documents)
    assert list(zip(origins.sources.tolist(), origins.rows.tolist(), strict=True)) == [
        (0, 1), (0, 4), (1, 1), (1, 4), (1, 7)
    ]  # fmt: skip
    assert [(s["format"], s["unit"]) for s in para.meta["sources"]] == [("paragraphs", "line")] * 2

    # the command line takes it by suffix, or by name for a file without a suffix, and lists it
    bare = tmp_path / "bare"
    bare.write_bytes((folder / "1.para").read_bytes())
    for given, extra in ((folder / "1.para", []), (bare, ["--input-format", "paragraphs"])):
        out = tmp_path / f"cli-{given.name}"
        argv = ["data", "pack", given, "-o", out, "--tokenizer", "bytes", *extra]
        assert cli(with_paragraphs, *argv)[0] == 0
        assert _texts(out) == paragraphs[1]
    _, listed, _ = cli(with_paragraphs, "plugins", "--json")
    entry = next(e for e in json.loads(listed)["entries"] if e["name"] == "paragraphs")
    assert (entry["kind"], entry["plugin"], entry["help"]) == (
        "data_format", "paragraphs", "blank-line paragraphs"
    )  # fmt: skip


def test_a_format_plugin_is_checked_and_named(tmp_path, installed):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')

    class Odd:
        @hookimpl
        def llmtrain_data_formats(self, register):
            register("odd", lambda options: object())

    class Misnamed:
        @hookimpl
        def llmtrain_data_formats(self, register):
            register("lines", lambda options: installed.build(DATA_FORMAT, "jsonl"))

    for plugin, expected in (
        (
            Odd(),
            "data_format 'odd' of plugin 'p' (registered in process) built a object, not an "
            "InputFormat; its factory must return an instance of a subclass of "
            "llmtrain.data_pack.formats.InputFormat",
        ),
        (
            Misnamed(),
            "data_format 'lines' of plugin 'p' (registered in process) built a format named "
            "'jsonl'; a format's name is its entry's",
        ),
    ):
        plugins = PluginManager().load_entry_points()
        plugins.register(plugin, "p")
        with pytest.raises(UserError) as info:
            pack([str(tmp_path / "a.jsonl")], str(tmp_path / "out"), BYTES, plugins=plugins)
        assert str(info.value) == expected
    assert not (tmp_path / "out").exists()


def test_a_suffix_claimed_twice_names_both_formats(installed):
    formats = dict(InputFormats.from_plugins(installed))

    class Other(InputFormat):
        name = "other-jsonl"
        suffixes = (".JSONL",)

        def plan(self, source, number, split_bytes, storage_options):
            return iter(())

        def read(self, task, selection, storage_options, limit_rows):
            raise AssertionError

    with pytest.raises(UserError, match=r"^input formats 'jsonl' and 'other-jsonl' both claim"):
        InputFormats({**formats, "other-jsonl": Other()})
