""".gz and .zst inputs, read to the end of every member or frame: a file cut short, corrupt or
not compressed at all is an error saying so, never the lines before the damage taken for the
whole file.

Python's gzip module raises EOFError on a cut; zstandard's stream reader ends quietly at a cut
(and fsspec's reads only the first frame of a file of several). Both are read here with the
libraries' decompression objects, a member or frame after another, so that what the file holds
is read whole or refused.
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol

READ_BYTES = 1 << 16  # compressed bytes given to the decoder at a time (bounds what one call makes)
NAMES = {"gzip": "gzip", "zstd": "zstd"}
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}  # how a member or frame starts


class DamagedStream(Exception):
    """A compressed file that does not decompress whole. `problem` reads after the file's name;
    `position` is how many of its (compressed) bytes had been read."""

    def __init__(self, problem: str, position: int):
        super().__init__(problem)
        self.problem = problem
        self.position = position


class _Decoder(Protocol):
    """What zlib's and zstandard's decompression objects have in common, as used here."""

    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes, /) -> bytes: ...


def _decoder(compression: str) -> _Decoder:
    if compression == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing, its CRC and size checked
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def _decode_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a dependency
        return (zlib.error,)
    return (zlib.error, zstandard.ZstdError)


class Decompressed:
    """The decompressed bytes of a gzip or zstd file object, a piece at a time (`read_some`), or
    all of it (`read_all`). Concatenated members (gzip) and frames (zstd) are read one after the
    other; zero bytes between gzip members are skipped, as gzip does."""

    def __init__(self, raw: Any, compression: str):
        self.raw = raw
        self.compression = compression
        self.position = 0  # compressed bytes read from `raw`
        self._decoder: _Decoder | None = None  # None: between members (or before the first)
        self._pending = b""  # compressed bytes not given to a decoder yet
        self._members = 0
        self._errors = _decode_errors()

    def read_some(self) -> bytes:
        """The next decompressed bytes; b"" at the end of the file. Raises DamagedStream."""
        name = NAMES[self.compression]
        while True:
            if not self._pending:
                self._pending = self.raw.read(READ_BYTES)
                self.position += len(self._pending)
                if not self._pending:
                    if self._decoder is not None:
                        unit = "member" if name == "gzip" else "frame"
                        raise DamagedStream(
                            f"cut short: the file ends at byte {self.position:,} inside a "
                            f"{name} {unit}",
                            self.position,
                        )
                    if not self._members:
                        raise DamagedStream(f"empty (0 bytes), not {name} data", 0)
                    return b""
            if self._decoder is None:
                if self.compression == "gzip" and self._members:
                    self._pending = self._pending.lstrip(b"\0")
                    if not self._pending:
                        continue
                self._decoder = _decoder(self.compression)
                self._members += 1
            data, self._pending = self._pending, b""
            try:
                out = self._decoder.decompress(data)
            except self._errors as exc:
                start = self.position - len(data)
                detail = " ".join(str(exc).split())
                if start == 0 and not data.startswith(MAGIC[self.compression]):
                    problem = f"not {name} data ({detail})"
                else:
                    problem = f"corrupt {name} data in bytes {start:,}-{self.position:,} ({detail})"
                raise DamagedStream(problem, self.position) from None
            if self._decoder.eof:
                self._pending = self._decoder.unused_data
                self._decoder = None
            if out:
                return out

    def read_all(self) -> bytes:
        pieces = []
        while piece := self.read_some():
            pieces.append(piece)
        return b"".join(pieces)
