"""`llmtrain data inspect`: what a packed dataset holds, at a glance or as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.plugins import PluginManager
from llmtrain.data_pack.integrity import CHECKSUM
from llmtrain.data_pack.sources import location
from llmtrain.data_pack.store import PackedDataset
from llmtrain.data_pack.tokenizer import tokenizer_from_raw

OFFSETS_BLOCK = 1 << 22


def length_histogram(dataset: PackedDataset) -> dict[str, int]:
    """Document lengths (tokens with eod) in power-of-two buckets, read in bounded blocks."""
    counts = np.zeros(64, dtype=np.int64)
    for begin in range(0, dataset.n_documents, OFFSETS_BLOCK):
        offsets = np.asarray(dataset.doc_offsets[begin : begin + OFFSETS_BLOCK + 1])
        lengths = np.diff(offsets)
        counts += np.bincount(np.log2(np.maximum(lengths, 1)).astype(np.int64), minlength=64)[:64]
    return {f"{1 << b}-{(1 << (b + 1)) - 1}": int(n) for b, n in enumerate(counts) if n}


def text_size(n_bytes: int | None, n_tokens: int) -> str | None:
    """The documents' text in UTF-8 and its bytes per token, eod tokens included (the ratio bits
    per byte takes): "40,123 bytes of text, 3.25 bytes a token"; None when not counted."""
    if n_bytes is None:
        return None
    return f"{n_bytes:,} bytes of text, {bytes_per_token(n_bytes, n_tokens):.2f} bytes a token"


def bytes_per_token(n_bytes: int | None, n_tokens: int) -> float | None:
    """The text's UTF-8 bytes per stored token (eod included), or None when not counted."""
    if n_bytes is None:
        return None
    return n_bytes / n_tokens if n_tokens else 0.0


def inspect_dataset(
    url: str,
    *,
    tokenizer: Mapping[str, Any] | None = None,
    window: int = 64,
    seed: int = 0,
    as_json: bool = False,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    plugins: PluginManager | None = None,
) -> str:
    """The report on a dataset. Opening it checks that every chunk is there with its recorded
    size; `verify` also reads every chunk and checks its checksum (a DamagedDatasetError names
    the damaged ones)."""
    dataset = PackedDataset(url, storage_options=storage_options)
    verified = dataset.verify() if verify else None
    meta = dataset.meta
    tok_meta = meta["tokenizer"]
    start = 0
    rng = np.random.default_rng(seed)
    if dataset.block is not None:  # chat: from the start of a block (a whole conversation)
        start = int(rng.integers(0, dataset.n_tokens // dataset.block)) * dataset.block
    elif dataset.n_tokens > window:
        start = int(rng.integers(0, dataset.n_tokens - window))
    ids = dataset.read(start, min(start + window, dataset.n_tokens))
    sample, note, tok = None, None, None
    try:
        tok = tokenizer_from_raw(dict(tokenizer or tok_meta["spec"]), plugins)
        dataset.check_tokenizer(tok)
        sample = tok.decode(ids.tolist())
    except UserError as exc:
        note = f"cannot decode the sample: {exc}"
        tok = None
    report = {
        "path": url,
        "counts": meta["counts"],
        "bytes_per_token": bytes_per_token(dataset.n_bytes, dataset.n_tokens),
        "dtype": meta["dtype"],
        "chunk_tokens": dataset.chunk_tokens,
        "tokenizer": {k: tok_meta[k] for k in ("name", "fingerprint", "vocab_size", "eod_id")},
        "sources": meta["sources"],
        "document_lengths": length_histogram(dataset),
        "bad_lines": meta.get("bad_lines", []),
        "filter": meta.get("filter"),
        "provenance": dataset.has_origins,
        "sample": {"start": start, "ids": ids.tolist(), "text": sample, "note": note},
        "created": meta.get("created"),
    }
    if verified is not None:
        report["verified"] = {
            "chunks": verified,
            "checked": "size and " + CHECKSUM if dataset.checksummed else "decoded",
        }
    if dataset.chat is not None:
        chat = dataset.chat
        report["chat"] = {
            "template": chat["template"]["name"],
            "stop": chat["template"]["stop"],
            "seq_len": chat["seq_len"],
            "roles": chat["roles"],
            "train_roles": chat["train_roles"],
            "too_long": chat["too_long"],
        }
        # PackedDataset refuses to open a chat dataset without its loss mask
        assert dataset.loss_mask is not None
        counted = np.flatnonzero(np.asarray(dataset.loss_mask[start : start + len(ids)]))
        report["sample"]["counted"] = counted.tolist()
        if tok is not None:  # each run of counted tokens, decoded: what the loss trains on
            runs = np.split(counted, np.flatnonzero(np.diff(counted) != 1) + 1)
            report["sample"]["counted_text"] = [
                tok.decode(ids[run].tolist()) for run in runs if len(run)
            ]
    if as_json:
        return json.dumps(report, indent=2)
    return _text(report)


def _text(r: dict[str, Any]) -> str:
    c, t = r["counts"], r["tokenizer"]
    mean = c["tokens"] / c["documents"] if c["documents"] else 0
    lines = [
        f"{r['path']}",
        f"  documents   {c['documents']:,} ({mean:,.1f} tokens each on average)",
        f"  tokens      {c['tokens']:,} ({r['dtype']}, chunks of {r['chunk_tokens']:,})",
        f"  skipped     {c['empty_documents']:,} empty documents, {c['bad_lines']:,} bad "
        f"records, {c['blank_lines']:,} blank lines",
        f"  tokenizer   {t['name']} (vocab {t['vocab_size']:,}, eod {t['eod_id']}, "
        f"fingerprint {t['fingerprint']})",
        f"  sources     {len(r['sources'])} file(s), "
        f"{sum(s['bytes'] for s in r['sources']):,} bytes{_formats(r['sources'])}; "
        f"provenance {'recorded' if r['provenance'] else 'not recorded'}",
        f"  created     {r['created']}",
        "  document lengths (tokens, with eod):",
    ]
    hist = r["document_lengths"]
    peak = max(hist.values(), default=1)
    for bucket, n in hist.items():
        lines.append(f"    {bucket:>15}  {n:>10,}  {'#' * max(1, round(40 * n / peak))}")
    chat = r.get("chat")
    if chat is not None:
        n = c["tokens"] or 1
        lines[5:5] = [
            f"  chat        template {chat['template']} (stop {', '.join(chat['stop'])}), "
            f"blocks of {chat['seq_len']:,} tokens, training on {', '.join(chat['train_roles'])}",
            f"  loss mask   {c['counted_tokens']:,} tokens counted ({c['counted_tokens'] / n:.1%}), "
            f"{c['padding_tokens']:,} padding ({c['padding_tokens'] / n:.1%}); "
            f"{c['too_long']:,} conversations too long ({chat['too_long']})",
        ]
    if chat is None:  # chat datasets count no bytes (see the README)
        size = text_size(c.get("bytes"), c["tokens"]) or (
            "bytes not counted (packed, or merged from a dataset packed, before llmtrain counted "
            "them: pack again for bits per byte)"
        )
        lines.insert(3, f"  text        {size}")
    if r["filter"]:
        dropped = c.get("dropped", 0)
        lines.append(
            f"  filter      {' and '.join(r['filter']['where'])}: {dropped:,} records dropped"
        )
        for source in r["sources"][:20]:
            lines.append(
                f"    {source['url']}: {source.get('kept', 0):,} kept, "
                f"{source.get('dropped', 0):,} dropped, {source.get('bad', 0):,} bad"
            )
        if len(r["sources"]) > 20:
            lines.append(f"    ... and {len(r['sources']) - 20} more files (--json lists all)")
    for bad in r["bad_lines"][:10]:
        where = bad["file"]
        for unit in ("line", "row"):
            if unit in bad:
                where = location(bad["file"], unit, bad[unit])
        lines.append(f"  bad record  {where}: {bad['reason']}")
    s = r["sample"]
    lines.append(f"  sample at token {s['start']:,}:")
    lines.append("    " + (repr(s["text"]) if s["text"] is not None else s["note"]))
    if s.get("counted_text") is not None:
        lines.append("  counted by the loss in the sample:")
        lines.extend(f"    {text!r}" for text in s["counted_text"])
    if r.get("verified") is not None:
        lines.append(_verified_line(r["verified"]))
    return "\n".join(lines)


def _verified_line(verified: dict[str, Any]) -> str:
    if verified["checked"] == "decoded":  # packed before checksums were recorded
        how = "each one decodes; no checksums were recorded: pack it again to have them"
    else:
        how = f"each one read whole against its recorded {verified['checked']}"
    return f"  integrity   all {verified['chunks']:,} chunks verified ({how})"


def _formats(sources: list[dict[str, Any]]) -> str:
    """ "(jsonl)" or "(parquet 3, jsonl 1)": the input formats (datasets packed before formats
    were recorded say nothing)."""
    counts: dict[str, int] = {}
    for source in sources:
        if "format" in source:
            counts[source["format"]] = counts.get(source["format"], 0) + 1
    if not counts:
        return ""
    if len(counts) == 1:
        return f" ({next(iter(counts))})"
    return " (" + ", ".join(f"{kind} {n}" for kind, n in counts.items()) + ")"
