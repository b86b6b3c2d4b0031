"""Token shards in the llm.c / modded-nanogpt ``.bin`` layout.

A shard is a header of 256 little-endian int32 followed by the tokens:

    header[0]  magic    20240520 for uint16 tokens, 20240801 for uint32 tokens
    header[1]  version  1 with uint16 tokens, 7 with uint32 tokens
    header[2]  number of tokens in the body
    header[3:] zero

Shards written by llm.c (``dev/data/data_common.py``) and modded-nanogpt load unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gpuflow.common.atomic import fsync_dir, write_atomic
from gpuflow.common.errors import GpuflowError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
COPY_TOKENS = 1 << 22  # tokens a shard rewritten in place is copied by at a time
# (magic, version) -> token dtype
FORMATS: dict[tuple[int, int], np.dtype] = {
    (20240520, 1): np.dtype("<u2"),
    (20240801, 7): np.dtype("<u4"),
}


def token_dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest shard token type that holds every id below ``vocab_size``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _header_for(dtype: np.dtype, n_tokens: int) -> np.ndarray:
    magic, version = next(key for key, value in FORMATS.items() if value == dtype)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, n_tokens)
    return header


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write one shard atomically; the token dtype picks the format (uint16 or uint32)."""
    dtype = np.dtype(tokens.dtype).newbyteorder("<")
    if dtype not in FORMATS.values():
        raise ValueError(f"shard tokens must be uint16 or uint32, got {tokens.dtype}")
    body = np.ascontiguousarray(tokens, dtype=dtype)
    write_atomic(path, [_header_for(dtype, body.size).tobytes(), memoryview(body).cast("B")])


@dataclass(frozen=True)
class Shard:
    """A validated shard on disk; ``tokens`` maps the body without reading it."""

    path: Path
    n_tokens: int
    dtype: np.dtype

    @classmethod
    def open(cls, path: Path | str) -> Shard:
        path = Path(path)
        if not path.is_file():
            if path.exists() or path.is_symlink():  # a folder, a pipe, a link to nothing...
                raise GpuflowError(
                    f"token shard {path} is not a regular file; put the shard itself there, "
                    "or prepare the data again"
                )
            raise GpuflowError(f"token shard {path} does not exist; run `gpuflow prepare` first")
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise GpuflowError(
                f"token shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                "it is truncated: prepare the data again"
            )
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
        magic, version, n_tokens = (int(v) for v in header[:3])
        known_magics = sorted({m for m, _ in FORMATS})
        if magic not in known_magics:
            raise GpuflowError(
                f"{path} is not a token shard: magic {magic}, expected one of {known_magics} "
                "(llm.c .bin format); prepare it with `gpuflow prepare`"
            )
        dtype = FORMATS.get((magic, version))
        if dtype is None:
            expected = [v for m, v in FORMATS if m == magic]
            raise GpuflowError(
                f"token shard {path} has version {version} for magic {magic}, expected {expected}; "
                "it was written by an unsupported tool version: prepare it again"
            )
        expected_size = HEADER_BYTES + n_tokens * dtype.itemsize
        if n_tokens < 0 or size != expected_size:
            state = "truncated" if size < expected_size else "longer than its header says"
            raise GpuflowError(
                f"token shard {path} is {state}: header says {n_tokens} tokens "
                f"({expected_size} bytes) but the file has {size} bytes; prepare the data again"
            )
        return cls(path, n_tokens, dtype)

    @property
    def tokens(self) -> np.ndarray:
        """The token body as a read-only memory map, shape (n_tokens,)."""
        if self.n_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=HEADER_BYTES)

    def max_token(self) -> int:
        return int(self.tokens.max()) if self.n_tokens else -1


class ShardWriter:
    """Streams ``{prefix}_{index:06d}.bin`` shards into ``folder``: tokens go to the open
    shard's file as they come, so no shard is ever held in memory, and ``finish`` makes it
    whole (header, fsync, then renamed into place: a reader never sees a partial shard).
    The caller finishes a shard once it is ``full``, at a boundary of its choosing."""

    def __init__(
        self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int, first_index: int = 0,
        existing: list[Path] | None = None,
    ) -> None:  # fmt: skip
        if shard_tokens <= 0:
            raise GpuflowError(f"shard size must be positive, got {shard_tokens} tokens")
        self.folder = Path(folder)
        self.prefix = prefix
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.index = first_index  # of the open shard
        self.paths: list[Path] = list(existing or [])  # finished (``existing``: earlier)
        self.open_tokens = 0
        self.total_tokens = 0  # added through this writer
        self._file: BinaryIO | None = None

    @property
    def full(self) -> bool:
        return self.open_tokens >= self.shard_tokens

    def _path(self, index: int) -> Path:
        return self.folder / f"{self.prefix}_{index:06d}.bin"

    def _temporary(self) -> Path:
        final = self._path(self.index)
        return final.with_name(f".{final.name}.tmp-{os.getpid()}")

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        if not tokens.size:
            return
        if self._file is None:
            self._file = open(self._temporary(), "wb")  # noqa: SIM115 - closed by finish
            self._file.write(bytes(HEADER_BYTES))  # the real header once the count is known
        self._file.write(memoryview(tokens).cast("B"))
        self.open_tokens += tokens.size
        self.total_tokens += tokens.size

    def finish(self) -> Path | None:
        """Close the open shard, if it holds tokens; its path."""
        if self._file is None:
            return None
        f, self._file = self._file, None
        try:
            f.seek(0)
            f.write(_header_for(self.dtype, self.open_tokens).tobytes())
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        path = self._path(self.index)
        os.replace(self._temporary(), path)
        fsync_dir(self.folder)
        self.paths.append(path)
        self.index += 1
        self.open_tokens = 0
        return path

    def take_tail(self, n: int) -> np.ndarray:
        """Remove and return the last ``n`` tokens added (at most those of the open shard, or
        of the last finished one when none is open)."""
        if self._file is None:
            if not self.paths:
                return np.zeros(0, dtype=self.dtype)
            # The last finished shard is opened again: its tokens are streamed into a new
            # open shard of the same name (which replaces it when finished), then cut below.
            last = Shard.open(self.paths.pop())
            self.index -= 1
            self.total_tokens -= last.n_tokens
            tokens = last.tokens  # (n_tokens,) a memory map: read a chunk at a time
            for start in range(0, last.n_tokens, COPY_TOKENS):
                self.add(tokens[start : start + COPY_TOKENS])
            del tokens
        n = min(n, self.open_tokens)
        self._file.flush()
        end = HEADER_BYTES + self.open_tokens * self.dtype.itemsize
        start = end - n * self.dtype.itemsize
        tail = np.fromfile(self._temporary(), dtype=self.dtype, count=n, offset=start)
        self._file.seek(start)
        self._file.truncate()
        self.open_tokens -= n
        self.total_tokens -= n
        if not self.open_tokens:
            self.abandon()
        return tail

    def close(self) -> list[Path]:
        self.finish()
        return self.paths

    def abandon(self) -> None:
        """Drop the open shard's partial file (after a failure)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._temporary().unlink(missing_ok=True)
        self.open_tokens = 0
