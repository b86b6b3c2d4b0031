"""An input's bytes as ``formats`` reads them: decompressed, their raw position counted, and a
damaged or truncated file named in one line.

gzip, bz2 and xz refuse a file cut short as they reach its end; zstd's decompressor stops
there without a word, so a .zst is walked frame by frame before anything is read
(``check_zstd_frames``).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import sys
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from gpuflow.common.errors import GpuflowError


class Input(Protocol):
    """What is read: a file (``path`` None: standard input), its compression (None, gzip,
    bz2, xz or zstd) and the name an error gives it (``formats.Input`` is one)."""

    path: Path | None
    compression: str | None

    @property
    def name(self) -> str: ...


class opened:
    """The input's bytes, decompressed, and a function giving the raw (compressed) position;
    decompression errors become one line naming the file."""

    def __init__(self, inp: Input) -> None:
        self.inp = inp

    def __enter__(self) -> tuple[BinaryIO, Any]:
        inp = self.inp
        if inp.path is None:
            raw = sys.stdin.buffer
            counted = _Counting(raw)
            return counted, lambda: counted.count
        self.raw = raw = open(inp.path, "rb")  # closed in __exit__
        stream: BinaryIO
        if inp.compression == "gzip":
            stream = gzip.GzipFile(fileobj=raw)
        elif inp.compression == "bz2":
            stream = bz2.BZ2File(raw)
        elif inp.compression == "xz":
            stream = lzma.LZMAFile(raw)
        elif inp.compression == "zstd":
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
            stream = io.BufferedReader(reader)
        else:
            stream = raw
        return _Checked(stream, inp), raw.tell

    def __exit__(self, *exc: object) -> None:
        if self.inp.path is not None:
            self.raw.close()


class _Counting(io.RawIOBase):
    """Standard input, counting the bytes read from it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.count = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        data = self.raw.readline(limit)
        self.count += len(data)
        return data


_DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


class _Checked:
    """A decompressing stream whose errors say which file is damaged."""

    def __init__(self, stream: BinaryIO, inp: Input) -> None:
        self.stream, self.inp, self.offset = stream, inp, 0
        try:
            import zstandard

            self._errors: tuple[type[BaseException], ...] = (
                *_DECOMPRESSION_ERRORS,
                zstandard.ZstdError,
            )
        except ImportError:
            self._errors = _DECOMPRESSION_ERRORS

    def _guard(self, read: Any, *args: Any) -> bytes:
        try:
            data = read(*args)
        except self._errors as exc:
            what = f"{self.inp.compression} data" if self.inp.compression else "data"
            raise GpuflowError(
                f"corpus file {self.inp.name} is not valid {what} past byte {self.offset} of its "
                f"contents ({exc}); it is damaged or truncated: fetch it again or leave it out"
            ) from None
        self.offset += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        return self._guard(self.stream.read, n)

    def readline(self) -> bytes:
        return self._guard(self.stream.readline)


# ---- a .zst cut short ---------------------------------------------------------------------

# A zstd frame's magic number, and the range of a skippable frame's (RFC 8878).
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = range(0x184D2A50, 0x184D2A60)


def check_zstd_frames(path: Path, given: str) -> None:
    """Refuse a .zst that ends inside a frame (cut short): its decompressor would stop there
    without a word, where gzip, bz2 and xz refuse it. Walks the frame and block headers,
    seeking past their contents, so a file of any size is checked in a few reads a block."""
    with open(path, "rb") as f:
        end, at = os.fstat(f.fileno()).st_size, 0
        while at < end:
            at = _zstd_frame_end(f, at)
            if at > end:
                raise GpuflowError(
                    f"corpus file {given} is not valid zstd data: it ends inside a frame, so "
                    "it is truncated: fetch it again or leave it out"
                )


def _zstd_frame_end(f: BinaryIO, at: int) -> int:
    """Where the frame starting at ``at`` ends (past the file's end: it is cut short). What is
    no frame at all is left to the decompressor, which names it."""
    f.seek(at)
    head = f.read(4)
    if len(head) < 4:
        return at + 4
    magic = int.from_bytes(head, "little")
    if magic in _SKIPPABLE:
        size = f.read(4)
        return at + 8 + int.from_bytes(size, "little") if len(size) == 4 else at + 8
    if magic != _ZSTD_MAGIC:
        return f.seek(0, os.SEEK_END)  # not a frame: the decompressor reports it
    descriptor = f.read(1)
    if not descriptor:
        return at + 6
    flags = descriptor[0]
    single_segment, checksum = flags >> 5 & 1, flags >> 2 & 1
    content_size = (single_segment, 2, 4, 8)[flags >> 6]
    at += 5 + (not single_segment) + (0, 1, 2, 4)[flags & 3] + content_size
    while True:  # the blocks: a 3-byte header each, the last one flagged
        f.seek(at)
        header = f.read(3)
        if len(header) < 3:
            return at + 3
        value = int.from_bytes(header, "little")
        size = 1 if (value >> 1 & 3) == 1 else value >> 3  # an RLE block holds one byte
        at += 3 + size
        if value & 1:
            return at + 4 * checksum
