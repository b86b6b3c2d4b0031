"""Pieces of text encoded to token ids on every core, in order, with bounded work in flight.

Pieces are grouped into tasks of about ``TASK_CHARS``; with more than one worker each task is
encoded in a worker process of its own (``tokenizers`` in each with one thread: turning
the ids into arrays is Python work, which one process would do on one core) and the results
come back in the order the pieces went in, at most ``2 x workers`` tasks at a time, so memory
does not grow with the corpus. Each piece is encoded on its own, so the ids do not depend on
how pieces were grouped or how many workers there are.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from gpuflow.data.pieces import Piece

# Characters of one task: a worker holds its text, ids and the tokenizer's own records of
# each token (tens of bytes a token) at once.
TASK_CHARS = 1 << 20
TASK_PIECES = 4096  # pieces of one task (many short documents)

_worker_tokenizer: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _start_worker(tokenizer_json: str, dtype: str) -> None:
    global _worker_tokenizer, _worker_dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process, one core
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    _worker_dtype = np.dtype(dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None and _worker_dtype is not None
    return encode_texts(_worker_tokenizer, texts, _worker_dtype)


def encode_texts(
    tokenizer: Tokenizer, texts: list[str], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The ids of every text, one after the other, and each text's count of them."""
    # The fast form leaves out the offsets, which nothing here reads (tokenizers >= 0.21).
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    arrays = [np.array(e.ids, dtype=dtype) for e in encodings]
    counts = np.array([a.size for a in arrays], dtype=np.int64)  # (len(texts),)
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)  # (sum of counts,)
    return ids, counts


class ParallelEncoder:
    """``encode(pieces)``: each piece with its ids, in order; a context manager (the pool)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> None:
        self.tokenizer, self.dtype, self.workers = tokenizer, np.dtype(dtype), max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ParallelEncoder:
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(
                self.workers,
                # Spawned, not forked: the parent may hold threads (tokenizers' own pool).
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.tokenizer.to_str(), self.dtype.str),
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def encode(self, pieces: Iterator[Piece]) -> Iterator[tuple[Piece, np.ndarray]]:
        """Each piece and its ids (without the end-of-text token), in the order given."""
        tasks = _tasks(pieces)
        if self._pool is None:
            for task in tasks:
                yield from _split(task, *encode_texts(self.tokenizer, [p.text for p in task],
                                                      self.dtype))  # fmt: skip
            return
        flight: deque[tuple[list[Piece], Future]] = deque()
        for task in tasks:
            flight.append((task, self._pool.submit(_encode_in_worker, [p.text for p in task])))
            if len(flight) >= 2 * self.workers:
                done, future = flight.popleft()
                yield from _split(done, *future.result())
        while flight:
            done, future = flight.popleft()
            yield from _split(done, *future.result())


def _tasks(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    task: list[Piece] = []
    chars = 0
    for piece in pieces:
        task.append(piece)
        chars += len(piece.text)
        if chars >= TASK_CHARS or len(task) >= TASK_PIECES:
            yield task
            task, chars = [], 0
    if task:
        yield task


def _split(
    task: list[Piece], ids: np.ndarray, counts: np.ndarray
) -> Iterator[tuple[Piece, np.ndarray]]:
    ends = np.cumsum(counts)
    for piece, start, end in zip(task, ends - counts, ends, strict=True):
        yield piece, ids[start:end]
