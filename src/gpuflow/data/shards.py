"""Token shards in the llm.c / modded-nanogpt ``.bin`` layout.

A shard is a header of 256 little-endian int32 followed by the tokens:

    header[0]  magic    20240520 for uint16 tokens, 20240801 for uint32 tokens
    header[1]  version  1 with uint16 tokens, 7 with uint32 tokens
    header[2]  number of tokens in the body
    header[3:] zero

Shards written by llm.c (``dev/data/data_common.py``) and modded-nanogpt load unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuflow.common.atomic import write_atomic
from gpuflow.common.errors import GpuflowError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
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
    """Accumulates tokens and writes ``{prefix}_{index:06d}.bin`` shards of a fixed size."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens <= 0:
            raise GpuflowError(f"shard size must be positive, got {shard_tokens} tokens")
        self.folder = Path(folder)
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self._buffer = np.empty(shard_tokens, dtype=self.dtype)
        self._filled = 0
        self.paths: list[Path] = []
        self.total_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self._filled)
            self._buffer[self._filled : self._filled + take] = tokens[:take]
            self._filled += take
            self.total_tokens += take
            tokens = tokens[take:]
            if self._filled == self.shard_tokens:
                self._flush()

    def take_tail(self, n: int) -> np.ndarray:
        """Remove and return up to ``n`` of the most recent tokens not yet written."""
        n = min(n, self._filled)
        tail = self._buffer[self._filled - n : self._filled].copy()
        self._filled -= n
        self.total_tokens -= n
        return tail

    def close(self) -> list[Path]:
        if self._filled:
            self._flush()
        return self.paths

    def _flush(self) -> None:
        path = self.folder / f"{self.prefix}_{len(self.paths):06d}.bin"
        write_shard(path, self._buffer[: self._filled])
        self.paths.append(path)
        self._filled = 0
