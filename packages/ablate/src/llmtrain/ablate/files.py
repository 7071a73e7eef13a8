"""Writing what the commands produce (tables, fits, reports, sweep manifests) so that a reader
never sees half a file: the text goes to `<name>.tmp` beside it, then replaces it in one rename."""

from __future__ import annotations

from pathlib import Path


def write_atomically(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path`, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
