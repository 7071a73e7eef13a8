"""data-pack's plugin (entry point `data_pack`): the `bytes`, `hf` and `tiktoken` tokenizers, the
input formats (`jsonl`, `text`, `text-lines`, `parquet`, `arrow`, `csv`, `tsv`) and the
`llmtrain data ...` commands (pack, pack-chat, train-tokenizer, inspect, merge), whose main
objects (the inputs, the dataset) are positional. Importing it is cheap: the commands import
their machinery when they run, and the formats import pyarrow only when they read Parquet or
Arrow."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from llmtrain.core_mesh.cli import Command, Context
from llmtrain.core_mesh.cli_conventions import json_option, main_object
from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import Register, hookimpl
from llmtrain.data_pack.builtin_formats import (
    ArrowFormat,
    JsonlFormat,
    ParquetFormat,
    TextFormat,
    TextLinesFormat,
)
from llmtrain.data_pack.csv_format import CsvFormat
from llmtrain.data_pack.progress import LOG_EVERY_SECONDS, ProgressSettings
from llmtrain.data_pack.tokenizer import (
    BytesOptions,
    BytesTokenizer,
    HFOptions,
    HFTokenizer,
    TiktokenOptions,
    TiktokenTokenizer,
)

if TYPE_CHECKING:
    from llmtrain.data_pack.chat import ChatSettings


@hookimpl
def llmtrain_tokenizers(register: Register) -> None:
    register(
        "bytes",
        BytesTokenizer,
        options=BytesOptions,
        help="UTF-8 bytes (ids 0-255) + special tokens; no file needed",
    )
    register(
        "hf",
        HFTokenizer,
        options=HFOptions,
        help="a Hugging Face tokenizer.json (fast tiktoken path for GPT-2-style BPE)",
    )
    register(
        "tiktoken",
        TiktokenTokenizer,
        options=TiktokenOptions,
        help="a .tiktoken ranks file with its split pattern",
    )


@hookimpl
def llmtrain_data_formats(register: Register) -> None:
    register(
        "jsonl",
        lambda _: JsonlFormat(),
        help="JSON lines (.jsonl, .ndjson, .json; any unclaimed suffix), the text at --field",
    )
    register("text", lambda _: TextFormat(), help="plain UTF-8 text (.txt), a document a file")
    register(
        "text-lines",
        lambda _: TextLinesFormat(),
        help="plain UTF-8 text, a document a line (.txt with --text-per-line)",
    )
    register(
        "parquet", lambda _: ParquetFormat(), help="Parquet files (.parquet), the --field column"
    )
    register(
        "arrow",
        lambda _: ArrowFormat(),
        help="Arrow IPC files (.arrow) and datasets.save_to_disk directories",
    )
    register(
        "csv",
        lambda _: CsvFormat("csv", ",", (".csv",)),
        help="comma-separated values with a header row (.csv), the text in the --field column",
    )
    register(
        "tsv",
        lambda _: CsvFormat("tsv", "\t", (".tsv",)),
        help="tab-separated values with a header row (.tsv), the text in the --field column",
    )


def _storage_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--storage-option {item!r}: expected key=value")
        options[key] = value
    return options


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option for remote paths (e.g. endpoint_url=...); AWS_* variables also work",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="a local folder for the JSON log file (rank0.jsonl); default: none, the log lines "
        "go to stderr only",
    )


def _progress_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar or progress log lines",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=LOG_EVERY_SECONDS,
        metavar="SECONDS",
        help="when stderr is not a terminal, log progress every SECONDS (default "
        f"{LOG_EVERY_SECONDS:g}); on a terminal a bar shows it",
    )


def _tokenizer_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--tokenizer",
        required=required,
        help="bytes, hf:PATH, tiktoken:PATH, or a tokenizer.json / .tiktoken path",
    )
    parser.add_argument(
        "--tokenizer-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tokenizer option, e.g. eod_token=</s> or encoding=cl100k_base",
    )


def _bad_line_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--on-bad-line",
        choices=["error", "skip"],
        default="error",
        help="a record that cannot be read: stop naming file:line, or skip and count it",
    )


def _dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=["uint16", "uint32"],
        default=None,
        help="the token dtype (default: uint16 where the vocabulary fits, else uint32)",
    )


def _configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _configure_pack(actions)
    _configure_pack_chat(actions)
    _configure_train_tokenizer(actions)
    _configure_inspect(actions)
    _configure_merge(actions)


def _configure_pack(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`llmtrain data pack`: corpora to a packed dataset."""
    p = actions.add_parser(
        "pack",
        help="tokenize corpora (JSONL, Parquet, ...) into a packed zarr dataset",
        description="tokenize corpora into a packed zarr dataset, each file read by the input "
        "format its suffix names (or --input-format); `llmtrain plugins` lists the formats "
        "(kind data_format). Local paths or URLs; globs and directories allowed",
    )
    main_object(p, "inputs", nargs="+", metavar="INPUT", help="files, globs or directories")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DATASET",
        help="the dataset to write (path or URL)",
    )
    _tokenizer_args(p, required=True)
    _record_selection_args(p)
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    _bad_line_arg(p)
    p.add_argument(
        "--skip-bad",
        dest="on_bad_line",
        action="store_const",
        const="skip",
        help="skip and count bad records, rows and unreadable files (= --on-bad-line skip)",
    )
    p.add_argument(
        "--max-doc-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="a document whose text is longer (UTF-8 bytes) is a bad record: an error naming "
        "file:line, or with --on-bad-line skip skipped and counted (default 0: no limit)",
    )
    _pack_layout_args(p)
    _progress_args(p)
    _common(p)


def _record_selection_args(parser: argparse.ArgumentParser) -> None:
    """pack's choice of records: the text field, --where filters, ids, the input format."""
    parser.add_argument(
        "--field", default="text", help="the text field or column (dotted for nested ones)"
    )
    parser.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="EXPR",
        help="keep only records where EXPR holds, e.g. 'int_score >= 3' or "
        '\'language in ["en", "de"]\' (repeatable: all must hold)',
    )
    parser.add_argument(
        "--id-field",
        default="id",
        help="the field recorded as each document's id, when a record has it (default: id)",
    )
    parser.add_argument(
        "--input-format",
        default="auto",
        metavar="FORMAT",
        help="how to read every input: auto (by each file's suffix; JSONL for a suffix no "
        "format claims) or a format's name; `llmtrain plugins` lists them (kind data_format)",
    )
    parser.add_argument(
        "--text-per-line",
        action="store_true",
        help="plain text inputs hold one document per line (default: one per file)",
    )


def _pack_layout_args(parser: argparse.ArgumentParser) -> None:
    """pack's output: overwrite, token dtype, chunks, shards, compression, task size."""
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _dtype_arg(parser)
    parser.add_argument("--chunk-tokens", type=int, default=1 << 20, help="tokens per zarr chunk")
    parser.add_argument(
        "--shard-chunks", type=int, default=0, help="chunks per shard (0: no sharding)"
    )
    parser.add_argument(
        "--compression",
        default="none",
        help="none (fastest local reads), zstd or zstd:LEVEL (smaller, for object storage)",
    )
    parser.add_argument(
        "--split-mb",
        type=float,
        default=None,
        help="input MB per worker task (default: enough tasks to keep every worker busy, <= 16)",
    )


def _configure_pack_chat(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`llmtrain data pack-chat`: conversations rendered with a chat template, with a loss mask."""
    c = actions.add_parser(
        "pack-chat",
        help="render JSONL conversations with a chat template into a packed dataset with a "
        "loss mask",
        description="render JSONL conversations (a list of {role, content} messages per record) "
        "with a chat template, tokenize them with a loss mask (assistant turns count), and lay "
        "them into blocks of --seq-len tokens that no conversation crosses",
    )
    main_object(c, "inputs", nargs="+", metavar="INPUT", help="JSONL files or globs")
    c.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DATASET",
        help="the dataset to write (path or URL)",
    )
    _tokenizer_args(c, required=True)
    c.add_argument(
        "--seq-len",
        type=int,
        required=True,
        help="the training sequence length (runs may use a multiple of it)",
    )
    c.add_argument(
        "--template",
        default="chatml",
        help="chatml (built in), a tokenizer_config.json with a chat_template, or a .jinja file",
    )
    c.add_argument("--template-name", default=None, help="which of several named templates")
    c.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TOKEN",
        help="the token that ends an assistant turn (default: <|im_end|> for chatml, the "
        "config's eos_token)",
    )
    c.add_argument("--messages-field", default="messages", help="dotted path of the messages")
    c.add_argument("--role-field", default="role", help="a message's role field")
    c.add_argument("--content-field", default="content", help="a message's text field")
    c.add_argument(
        "--roles", default="system,user,assistant,tool", help="the roles a message may have"
    )
    c.add_argument("--train-roles", default="assistant", help="roles whose tokens the loss counts")
    c.add_argument(
        "--too-long",
        choices=["skip", "truncate", "error"],
        default="skip",
        help="conversations longer than --seq-len: skip or truncate them (counted), or stop",
    )
    c.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    _bad_line_arg(c)
    c.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _dtype_arg(c)
    c.add_argument("--chunk-tokens", type=int, default=1 << 20, help="tokens per zarr chunk")
    c.add_argument("--compression", default="none", help="none, zstd or zstd:LEVEL")
    _progress_args(c)
    _common(c)


def _configure_train_tokenizer(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """`llmtrain data train-tokenizer`: a byte-level BPE tokenizer.json from corpora."""
    text = (
        "train a byte-level BPE tokenizer on a corpus in any input format pack reads and write "
        "tokenizer.json"
    )
    t = actions.add_parser("train-tokenizer", help=text, description=text)
    main_object(
        t,
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files (read by the format their suffix names), globs or directories",
    )
    t.add_argument(
        "-o", "--output", required=True, metavar="FILE.json", help="the tokenizer.json to write"
    )
    t.add_argument("--vocab-size", type=int, required=True, help="the vocabulary size to reach")
    t.add_argument(
        "--field", default="text", help="the text field or column (dotted for nested ones)"
    )
    t.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen at least this often"
    )
    t.add_argument(
        "--special-token",
        action="append",
        default=None,
        help="special tokens (default: <|endoftext|>); the first ends documents",
    )
    t.add_argument("--max-documents", type=int, default=None, help="train on the first N documents")
    t.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    _progress_args(t)
    _common(t)


def _configure_inspect(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`llmtrain data inspect`: a dataset's counts and a decoded sample; --verify."""
    i = actions.add_parser(
        "inspect",
        help="counts, tokenizer, document lengths and a decoded sample of a dataset; --verify "
        "checks every chunk",
    )
    main_object(i, "path", metavar="DATASET", help="a packed dataset (path or URL)")
    i.add_argument("--window", type=int, default=64, help="tokens in the decoded sample")
    i.add_argument("--seed", type=int, default=0, help="which sample window")
    json_option(i)
    i.add_argument(
        "--verify",
        action="store_true",
        help="read every chunk and check it against its recorded checksum (exit 2 naming the "
        "first damaged chunk)",
    )
    _tokenizer_args(i, required=False)
    _common(i)


def _configure_merge(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`llmtrain data merge`: packed datasets of one tokenizer concatenated."""
    m = actions.add_parser("merge", help="concatenate packed datasets of one tokenizer")
    main_object(m, "inputs", nargs="+", metavar="DATASET", help="packed datasets, in order")
    m.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DATASET",
        help="the dataset to write (path or URL)",
    )
    m.add_argument("--overwrite", action="store_true", help="replace an existing output")
    m.add_argument("--compression", default="none", help="none, zstd or zstd:LEVEL")
    _common(m)


def _run(args: argparse.Namespace, ctx: Context) -> int:
    from llmtrain.core_mesh.logs import configure_logging

    if args.log_dir is not None and "://" in args.log_dir:
        raise UserError(
            f"--log-dir {args.log_dir}: the JSON log is written to a local folder; "
            "give a local path"
        )
    if (
        args.log_dir is not None
        and os.path.exists(args.log_dir)
        and not os.path.isdir(args.log_dir)
    ):
        raise UserError(f"--log-dir {args.log_dir}: a file, not a folder; give a folder")
    configure_logging(log_dir=args.log_dir, level="INFO")
    storage_options = _storage_options(args.storage_option)
    if args.action in ("pack", "pack-chat"):
        return _pack(args, ctx, storage_options)
    if args.action == "train-tokenizer":
        return _train(args, ctx, storage_options)
    if args.action == "inspect":
        from llmtrain.data_pack.report import inspect_dataset

        tokenizer = _tokenizer_raw(args, ctx) if args.tokenizer else None
        print(
            inspect_dataset(
                args.path,
                tokenizer=tokenizer,
                window=args.window,
                seed=args.seed,
                as_json=args.json,
                verify=args.verify,
                storage_options=storage_options,
                plugins=ctx.plugins,
            )
        )
        return 0
    from llmtrain.data_pack.merge import merge
    from llmtrain.data_pack.report import text_size

    merged = merge(
        args.inputs,
        args.output,
        overwrite=args.overwrite,
        compression=args.compression,
        storage_options=storage_options,
    )
    size = text_size(merged.n_bytes, merged.tokens)
    text = "" if size is None else f", {size}"
    print(f"{args.output}: {merged.documents} documents, {merged.tokens} tokens{text}")
    return 0


def _progress(args: argparse.Namespace) -> ProgressSettings:
    if args.progress_every < 0:
        raise UserError(f"--progress-every {args.progress_every:g}: give 0 or more seconds")
    return ProgressSettings.for_stderr(not args.no_progress, args.progress_every)


def _tokenizer_raw(args: argparse.Namespace, ctx: Context) -> dict[str, Any]:
    from llmtrain.data_pack.tokenizer import choice_to_raw, tokenizer_choice

    choice = tokenizer_choice(args.tokenizer, ctx.plugins, args.tokenizer_option)
    return choice_to_raw(choice, ctx.plugins)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _chat_settings(args: argparse.Namespace) -> ChatSettings:
    from llmtrain.data_pack.chat import ChatSettings, ChatTemplate

    template = ChatTemplate.load(args.template, stop=args.stop, name=args.template_name)
    return ChatSettings(
        template.to_meta(),
        args.seq_len,
        messages_field=args.messages_field,
        role_field=args.role_field,
        content_field=args.content_field,
        roles=_names(args.roles),
        train_roles=_names(args.train_roles),
        too_long=args.too_long,
    )


def _pack(args: argparse.Namespace, ctx: Context, storage_options: dict[str, Any]) -> int:
    from llmtrain.data_pack.pack import pack

    chat = _chat_settings(args) if args.action == "pack-chat" else None
    summary = pack(
        args.inputs,
        args.output,
        _tokenizer_raw(args, ctx),
        chat=chat,
        field=getattr(args, "field", "text"),
        where=getattr(args, "where", ()),
        id_field=getattr(args, "id_field", "id"),
        input_format=getattr(args, "input_format", "auto"),
        text_per_line=getattr(args, "text_per_line", False),
        max_doc_bytes=getattr(args, "max_doc_bytes", 0),
        workers=args.workers,
        on_bad_line=args.on_bad_line,
        overwrite=args.overwrite,
        dtype=args.dtype,
        chunk_tokens=args.chunk_tokens,
        shard_chunks=getattr(args, "shard_chunks", 0),
        compression=args.compression,
        split_bytes=(
            None
            if getattr(args, "split_mb", None) is None
            else max(1, int(args.split_mb * (1 << 20)))
        ),
        storage_options=storage_options,
        plugins=ctx.plugins,
        progress=_progress(args),
    )
    unit = "lines" if chat is not None else "records"
    skipped = f", {summary.bad_lines} bad {unit} skipped" if summary.bad_lines else ""
    filtered = f", {summary.dropped} dropped by --where" if summary.dropped else ""
    if chat is not None:
        from llmtrain.data_pack.store import PackedDataset

        c = PackedDataset(summary.url, storage_options=storage_options).meta["counts"]
        action = {"skip": "skipped", "truncate": "truncated", "error": ""}[chat.too_long]
        print(
            f"{summary.url}: {summary.documents} conversations, {summary.tokens} tokens "
            f"({c['counted_tokens']} counted by the loss, {c['padding_tokens']} padding; "
            f"{c['too_long']} too long {action}{skipped}) in {summary.seconds:.1f} s"
        )
        return 0
    from llmtrain.data_pack.report import text_size

    size = text_size(summary.n_bytes, summary.tokens)
    print(
        f"{summary.url}: {summary.documents} documents, {summary.tokens} tokens "
        f"({summary.empty_documents} empty skipped{skipped}{filtered}) in "
        f"{summary.seconds:.1f} s, "
        f"{summary.tokens_per_second:,.0f} tokens/s{'' if size is None else '; ' + size}"
    )
    return 0


def _train(args: argparse.Namespace, ctx: Context, storage_options: dict[str, Any]) -> int:
    from llmtrain.data_pack.train_tokenizer import train_tokenizer

    vocab = train_tokenizer(
        args.inputs,
        args.output,
        vocab_size=args.vocab_size,
        field=args.field,
        min_frequency=args.min_frequency,
        special_tokens=args.special_token or None,
        max_documents=args.max_documents,
        overwrite=args.overwrite,
        storage_options=storage_options,
        progress=_progress(args),
        plugins=ctx.plugins,
    )
    print(f"{args.output}: byte-level BPE, {vocab} tokens")
    return 0


@hookimpl
def llmtrain_commands(register: Register) -> None:
    register(
        "data",
        lambda _: Command(
            help="pack corpora (JSONL, Parquet, ...; or chat conversations) into token "
            "datasets, train tokenizers, inspect and merge datasets",
            configure=_configure,
            run=_run,
        ),
    )
