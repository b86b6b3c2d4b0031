"""Pieces of text encoded to token ids on every core, in order, with bounded work in flight.

Pieces are grouped into tasks of about ``TASK_CHARS``; with more than one worker each task is
encoded in a worker process of its own (``tokenizers`` in each with one thread: turning
the ids into arrays is Python work, which one process would do on one core) and the results
come back in the order the pieces went in, at most ``2 x workers`` tasks at a time, so memory
does not grow with the corpus. Each piece is encoded on its own, so the ids do not depend on
how pieces were grouped or how many workers there are.

A worker's memory does not grow with a piece either: it encodes ``BATCH_CHARS`` at a time,
a longer piece in parts cut where its tokens cannot change. How many workers the memory
allows, and why: docs/decisions/047.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from array import array
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from gpuflow.common.orphans import exit_with_parent
from gpuflow.common.signals import interrupts_held, take_interrupts_in_child
from gpuflow.data.prepare.pieces import Cutter, Piece

# Main-process code imports numpy where it runs: the workers import this module, and numpy
# would add its own memory to every one of them.
if TYPE_CHECKING:
    import numpy as np

# Characters of one task: the main process holds two tasks a worker, in flight.
TASK_CHARS = 1 << 18
TASK_PIECES = 4096  # pieces of one task (many short documents)
# Characters a worker encodes at once: it holds the tokenizer's records of each of their
# tokens (tens of bytes a token) until their ids are copied out.
BATCH_CHARS = 1 << 16
# The memory every worker may take together, and what one takes besides its copy of the
# tokenizer: an interpreter with ``tokenizers``, a task and a batch's records.
WORKERS_MEMORY = 3 << 30
WORKER_BYTES = 52 << 20
# A loaded tokenizer takes about this many times the size of its JSON in memory.
TOKENIZER_MEMORY_PER_JSON_BYTE = 10

_worker: IdEncoder | None = None
_trim_heap: Any = None  # glibc's malloc_trim, where there is one


class WorkerLost(Exception):
    """An encoding process ended before its task was done (killed: the machine out of memory,
    a signal); the pool cannot go on."""


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(tokenizer: Tokenizer, cores: int | None = None) -> int:
    """A worker a core (``cores``, default: the usable ones), but no more than
    ``WORKERS_MEMORY`` holds at ``WORKER_BYTES`` and a copy of ``tokenizer`` each."""
    each = WORKER_BYTES + TOKENIZER_MEMORY_PER_JSON_BYTE * len(tokenizer.to_str())
    return max(1, min(cores or usable_cores(), WORKERS_MEMORY // each))


def text_encoder(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that encodes a document's own text as text: "<|endoftext|>"
    written in it (tokenizer code, a web page about one) as its characters, not as the
    boundary token, which only prepare puts between documents. (A copy: the caller's
    tokenizer is its own; the setting is not saved with it.)"""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


class IdEncoder:
    """``encoder(texts)``: the ids of every text, one after the other, in an ``array`` of
    ``itemsize`` bytes each, and each text's count of them. Uses no numpy (see above)."""

    def __init__(self, tokenizer: Tokenizer, itemsize: int, batch_chars: int = BATCH_CHARS) -> None:
        tokenizer = text_encoder(tokenizer)
        self.tokenizer, self.batch_chars = tokenizer, batch_chars
        self.typecode = next(code for code in "HI" if array(code).itemsize == itemsize)
        # Cut only where the cut is proven harmless: anything else is encoded whole.
        self.cutter = Cutter(tokenizer)
        # The fast form leaves out the offsets, which nothing here reads (tokenizers >= 0.21).
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def __call__(self, texts: list[str]) -> tuple[array, list[int]]:
        ids, counts = array(self.typecode), [0] * len(texts)
        batch: list[str] = []
        owners: list[int] = []  # the text each entry of ``batch`` is part of
        chars = 0
        for owner, text in enumerate(texts):
            for part in self.cutter.parts(text, self.batch_chars):
                batch.append(part)
                owners.append(owner)
                chars += len(part)
                if chars >= self.batch_chars:
                    self._flush(batch, owners, ids, counts)
                    batch, owners, chars = [], [], 0
        self._flush(batch, owners, ids, counts)
        return ids, counts

    def _flush(self, batch: list[str], owners: list[int], ids: array, counts: list[int]) -> None:
        for owner, encoding in zip(owners, self._encode(batch, add_special_tokens=False),
                                   strict=True):  # fmt: skip
            these = encoding.ids  # a new list at each read
            ids.extend(these)
            counts[owner] += len(these)


def _start_worker(tokenizer_file: str, itemsize: int, batch_chars: int, parent: int) -> None:
    global _worker, _trim_heap
    take_interrupts_in_child()
    exit_with_parent(parent)
    # One process, one core: no pool of threads in tokenizers (they would each hold memory).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker = IdEncoder(Tokenizer.from_file(tokenizer_file), itemsize, batch_chars)
    _trim_heap = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _encode_in_worker(texts: list[str]) -> tuple[array, list[int]]:
    assert _worker is not None
    result = _worker(texts)
    if _trim_heap is not None:
        # The C heap keeps the pages a task's records freed, in every worker: give them back.
        _trim_heap(0)
    return result


def _as_numpy(ids: array, counts: list[int], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    native = np.frombuffer(ids, dtype=dtype.newbyteorder("="))  # (sum of counts,)
    return native.astype(dtype, copy=False), np.array(counts, dtype=np.int64)


class ParallelEncoder:
    """``encode(pieces)``: each piece with its ids, in order; a context manager (the pool).

    The tokenizer is given as its saved file, which every worker loads for itself: the
    arguments a spawned worker starts with go down a pipe that holds 64 KiB, so a tokenizer's
    JSON sent that way (a megabyte at 16,000 tokens) would hold each start until the worker
    before it had booted and read it all, one worker at a time."""

    def __init__(self, tokenizer_file: Path, dtype: np.dtype, workers: int) -> None:
        import numpy as np

        self.tokenizer_file, self.dtype = Path(tokenizer_file), np.dtype(dtype)
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ParallelEncoder:
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(
                self.workers,
                # Spawned, not forked: the parent may hold threads (tokenizers' own pool).
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(str(self.tokenizer_file), self.dtype.itemsize, BATCH_CHARS, os.getpid()),
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
            tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
            here = IdEncoder(tokenizer, self.dtype.itemsize, BATCH_CHARS)
            for task in tasks:
                yield from _split(task, *_as_numpy(*here([p.text for p in task]), self.dtype))
            return
        try:
            yield from self._pooled(tasks)
        except BrokenProcessPool:
            raise WorkerLost from None

    def _pooled(self, tasks: Iterator[list[Piece]]) -> Iterator[tuple[Piece, np.ndarray]]:
        assert self._pool is not None
        flight: deque[tuple[list[Piece], Future]] = deque()
        for task in tasks:
            with interrupts_held():  # a submit may start a worker
                future = self._pool.submit(_encode_in_worker, [p.text for p in task])
            flight.append((task, future))
            if len(flight) >= 2 * self.workers:
                done, future = flight.popleft()
                yield from _split(done, *_as_numpy(*future.result(), self.dtype))
        while flight:
            done, future = flight.popleft()
            yield from _split(done, *_as_numpy(*future.result(), self.dtype))


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
    ends = counts.cumsum()
    for piece, start, end in zip(task, ends - counts, ends, strict=True):
        yield piece, ids[start:end]
