"""How a planned batch is written into a host buffer: ``PackPlan`` (a batch laid out, with the
host tensors that fill it) and the copies that fill it, whole or in jobs for threads to
share; ``Packed``, a buffer so filled.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.transfer.packing.spec import Leaf, PackLayout, _view

_MEMMOVE_MAX_BYTES = 256 << 10  # beyond this torch's copy (threaded, lock released) is faster


class PackPlan:
    """A batch measured and laid out, ready to be written into any buffer of ``nbytes``:
    its ``PackLayout`` and, leaf by leaf, the host tensor (or list of same-shape tensors to
    stack) that fills it."""

    __slots__ = ("layout", "sources")

    def __init__(self, layout: PackLayout, sources: tuple[Any, ...]) -> None:
        self.layout, self.sources = layout, sources

    @property
    def spec(self) -> Any:
        return self.layout.spec

    @property
    def nbytes(self) -> int:
        """Bytes the plan takes in a staging buffer (staged tensors, alignment padding
        included); direct tensors take none."""
        return self.layout.nbytes

    @property
    def logical_nbytes(self) -> int:
        """Bytes the tensors occupy as given (before narrowing or compression)."""
        return self.layout.logical_nbytes

    @property
    def wire_nbytes(self) -> int:
        """Bytes of the batch on the wire: from its first staged tensor to its last (the
        alignment padding between them included), and its direct tensors."""
        return self.layout.wire_nbytes

    @property
    def has_staged(self) -> bool:
        return self.layout.has_staged

    @property
    def has_direct(self) -> bool:
        return self.layout.has_direct

    def write_into(self, buffer: torch.Tensor, offset: int = 0) -> None:
        """Copy every staged tensor into ``buffer[offset:]`` (uint8, room for ``nbytes``),
        converting codecs."""
        layout = self.layout
        _check_buffer(buffer, offset + layout.nbytes)
        base = buffer.data_ptr() + offset
        leaves, sources, runs = layout.leaves, self.sources, layout.write_runs
        i = 0
        while i < len(leaves):
            leaf, source = leaves[i], sources[i]
            run = runs.get(i) if runs else None
            if run is not None:  # tensors end to end in the buffer: one call for them all
                count, whole = run
                torch.stack(sources[i : i + count], out=_view(buffer, whole, whole.wire, offset))
                i += count
                continue
            i += 1
            if leaf.direct:
                continue
            if 0 < leaf.nbytes <= _MEMMOVE_MAX_BYTES and _crosses_as_is(source, leaf):
                # small: one memmove, not four torch calls
                ctypes.memmove(base + leaf.offset, source.data_ptr(), leaf.nbytes)
                continue
            _write_with_torch(buffer, offset, leaf, source)

    def write_jobs(
        self, buffer: torch.Tensor, chunk: int, offset: int = 0
    ) -> list[Callable[[], object]]:
        """``write_into(buffer, offset)`` split for threads to share: each tensor that crosses
        as it is becomes byte ranges of about ``chunk``, returned as jobs that each copy one
        by ``memmove`` (a plain memcpy that lets go of the interpreter lock, so that jobs on
        several threads copy in parallel); each converted, stacked or strided tensor is
        written now, on this thread, where torch's copy runs on its intra-op threads (on a
        thread of its own the same copy is slower: docs/decisions/041)."""
        layout = self.layout
        _check_buffer(buffer, offset + layout.nbytes)
        base = buffer.data_ptr() + offset
        jobs: list[Callable[[], object]] = []
        for leaf, source, direct in zip(layout.leaves, self.sources, layout.direct, strict=True):
            if direct:
                continue
            if not _crosses_as_is(source, leaf):
                _write_with_torch(buffer, offset, leaf, source)
                continue
            dst, src = base + leaf.offset, source.data_ptr()
            for begin in range(0, leaf.nbytes, chunk):
                n = min(chunk, leaf.nbytes - begin)
                # (the source is bound too, so that it outlives the job)
                jobs.append(lambda d=dst + begin, s=src + begin, n=n, _=source: _memmove(d, s, n))
        return jobs

    def direct_pairs(self) -> list[tuple[Leaf, torch.Tensor]]:
        """Each direct leaf with the pinned tensor it is copied from, in leaf order."""
        leaves, sources = self.layout.leaves, self.sources
        return [(leaves[i], sources[i]) for i in self.layout.direct_leaves]


@dataclass(frozen=True)
class Packed:
    """A batch coalesced into ``buffer[:nbytes]``; ``spec`` says how to rebuild it."""

    buffer: torch.Tensor
    nbytes: int
    logical_nbytes: int
    spec: Any


def _write_with_torch(
    buffer: torch.Tensor, offset: int, leaf: Leaf, source: torch.Tensor | list[torch.Tensor]
) -> None:
    """``source`` converted into the leaf's place in ``buffer`` by torch (a list stacked by
    one call)."""
    target = _view(buffer, leaf, leaf.wire, offset)
    if isinstance(source, list):
        torch.stack(source, out=target)
    else:
        target.copy_(source)


def _memmove(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def _check_buffer(buffer: torch.Tensor, needed: int) -> None:
    if buffer.dtype != torch.uint8 or buffer.numel() < needed or buffer.stride(0) != 1:
        raise ValueError(f"need a contiguous uint8 buffer of >= {needed} bytes")


def _crosses_as_is(source: torch.Tensor | list[torch.Tensor], leaf: Leaf) -> bool:
    """Whether ``source`` is one host tensor whose bytes are the leaf's as they lie."""
    return (
        isinstance(source, torch.Tensor)
        and source.dtype == leaf.wire
        and source.is_cpu
        and _bytes_as_they_lie(source)
    )


def _bytes_as_they_lie(tensor: torch.Tensor) -> bool:
    """Whether a copy of ``tensor``'s bytes is the tensor: contiguous, with no lazy
    conjugate or negation (a view flag that a byte copy would drop)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
