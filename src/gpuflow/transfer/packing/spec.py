"""What a packed batch is made of: where each tensor lies in the one buffer, and the tree of
containers that rebuilds the batch from it.

``Leaf`` places one tensor; ``_Node``, ``_StackSpec`` and ``_RaggedSpec`` hold the batch's
structure around the leaves; ``PackLayout`` is all of it for one batch, the same for every
batch of one structure, shapes and codecs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError

ALIGN = 16  # bytes: every view aligned for any dtype and for 16-byte vector loads
SIDE_STREAM_BYTES = 4 << 20  # copies this large overlap compute on a stream of their own
_MIN_RUN = 4  # children in a run: fewer are cheaper one by one


@dataclass(frozen=True)
class Ragged:
    """Integer sequences of different lengths as one flat ``values`` tensor and ``offsets``.

    Sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``. ``host_offsets`` keeps the
    offsets on the host too, so slicing a device ``Ragged`` never makes the host wait.
    """

    values: torch.Tensor  # (total,)
    offsets: torch.Tensor  # (n + 1,) int64
    host_offsets: tuple[int, ...]

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int] | np.ndarray]) -> Ragged:
        try:
            arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        except OverflowError:
            raise GpuflowError(
                "ragged sequences hold an integer outside int64's range, which they are stored "
                "in; pass ids that fit in 64 bits"
            ) from None
        lengths = [a.size for a in arrays]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(torch.from_numpy(values), torch.from_numpy(offsets), tuple(offsets.tolist()))

    def __len__(self) -> int:
        return len(self.host_offsets) - 1

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> Ragged: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | Ragged:
        """Sequence ``i`` (negative counts from the end), or the sequences of a slice as a
        ``Ragged`` sharing this one's values."""
        if isinstance(i, slice):
            first, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError(f"a Ragged slice takes sequences in a row, not step {step}")
            stop = max(first, stop)
            start = self.host_offsets[first]
            return Ragged(
                self.values[start : self.host_offsets[stop]],
                self.offsets[first : stop + 1] - start,
                tuple(o - start for o in self.host_offsets[first : stop + 1]),
            )
        index = operator.index(i)
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sequence {i} of a Ragged of {n}")
        index %= n
        return self.values[self.host_offsets[index] : self.host_offsets[index + 1]]

    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.host_offsets, self.host_offsets[1:], strict=False)]


@dataclass(frozen=True)
class Leaf:
    """Where one tensor lives in the packed buffer and what it becomes on the device."""

    offset: int  # bytes from the start of the buffer
    nbytes: int
    shape: tuple[int, ...]
    wire: torch.dtype  # as stored in the buffer
    dtype: torch.dtype  # as delivered
    # copied from its source into a device tensor of its own, not through the buffer (its
    # offset is then meaningless and it takes no room in the buffer)
    direct: bool = False
    pin: bool = False  # direct, from pageable memory: pinned (``pin_memory()``) first
    # Stored in its source's memory order (``shape`` is that order's): the dimensions to
    # permute back to, so that it arrives with its source's strides (channels_last, a
    # transpose), as ``.to()`` keeps them. None: stored and delivered contiguous.
    order: tuple[int, ...] | None = None

    def delivered(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (stored shape) as the source had it: its dimensions permuted back."""
        return tensor if self.order is None else tensor.permute(self.order)


@dataclass(frozen=True)
class _RaggedSpec:
    values: Leaf
    offsets: Leaf
    host_offsets: tuple[int, ...]


@dataclass(frozen=True)
class _StackSpec:
    """A list or tuple of same-shape, same-dtype tensors, stored as one (N, ...) leaf: one
    copy to pack it, one conversion and one ``unbind`` to rebuild it, however long it is."""

    leaf: Leaf
    kind: type


@dataclass(frozen=True)
class _Node:
    """A container in the spec tree: a mapping (with ``keys``), namedtuple, list or tuple.

    ``runs``: (first child, leaf) for each run of ``_MIN_RUN`` or more children that are
    staged tensors of one shape and dtype lying end to end in the buffer (the columns of a
    table, say), with ``leaf`` covering the whole run as one (count, *shape) tensor: such a
    run is written by one ``torch.stack`` and rebuilt by one view and one ``unbind``, which
    cost the host less than a view per tensor (docs/decisions/040)."""

    kind: Callable[..., Any]
    children: tuple[Any, ...]
    keys: tuple[Any, ...] | None = None
    keywords: bool = False  # a dataclass: built as kind(**fields)
    runs: tuple[tuple[int, Leaf], ...] = ()

    @classmethod
    def of(
        cls, kind: Callable[..., Any], children: tuple[Any, ...],
        keys: tuple[Any, ...] | None = None, keywords: bool = False,
    ) -> _Node:  # fmt: skip
        return cls(kind, children, keys, keywords, _sibling_runs(children))

    def build(self, items: list[Any]) -> Any:
        if self.keywords:
            return self.kind(**dict(zip(self.keys, items, strict=True)))
        if self.keys is not None:
            return self.kind(zip(self.keys, items, strict=True))
        if hasattr(self.kind, "_fields"):
            return self.kind(*items)
        return self.kind(items)

    def items(self, one: Callable[[Any], Any], run: Callable[[Leaf], list[Any]]) -> list[Any]:
        """The children's items in order: ``one(child)`` for a child, ``run(leaf)`` (a list
        of the run's items) for each run."""
        if not self.runs:
            return [one(child) for child in self.children]
        out: list[Any] = []
        runs = iter(self.runs)
        start, leaf = next(runs, (-1, None))
        i = 0
        while i < len(self.children):
            if i == start:
                out.extend(run(leaf))  # type: ignore[arg-type]
                i += leaf.shape[0]  # type: ignore[union-attr]
                start, leaf = next(runs, (-1, None))
            else:
                out.append(one(self.children[i]))
                i += 1
        return out


def _nodes(spec: Any) -> Iterator[_Node]:
    """Every ``_Node`` of a spec tree."""
    if isinstance(spec, _Node):
        yield spec
        for child in spec.children:
            yield from _nodes(child)


def _sibling_runs(children: tuple[Any, ...]) -> tuple[tuple[int, Leaf], ...]:
    """The runs of ``children`` (see ``_Node``)."""

    def joins(leaf: Any) -> bool:
        return (
            type(leaf) is Leaf
            and not leaf.direct
            and leaf.order is None
            and leaf.nbytes > 0
            and leaf.nbytes % ALIGN == 0  # (so the next one starts where it ends)
        )

    runs: list[tuple[int, Leaf]] = []
    i = 0
    while i < len(children):
        first = children[i]
        j = i + 1
        if joins(first):
            while j < len(children):
                leaf, last = children[j], children[j - 1]
                if not (joins(leaf) and leaf.shape == first.shape and leaf.wire == first.wire
                        and leaf.dtype == first.dtype
                        and leaf.offset == last.offset + last.nbytes):  # fmt: skip
                    break
                j += 1
        if j - i >= _MIN_RUN:
            whole = Leaf(first.offset, first.nbytes * (j - i), (j - i, *first.shape),
                         first.wire, first.dtype)  # fmt: skip
            runs.append((i, whole))
        i = j
    return tuple(runs)


class PackLayout:
    """Where each tensor of a batch goes in the packed buffer, and the spec to rebuild it:
    everything about a plan except the tensors themselves. Batches of one structure, shapes
    and codecs share one ``PackLayout`` (see ``Planner``), which lets a loader rebuild a run
    of them at once.

    ``nbytes`` is the buffer's share (staged leaves, alignment padding included);
    ``wire_nbytes`` the batch's bytes from its first staged tensor to its last (the padding
    between them included) and its direct leaves; ``copied_nbytes`` what its copies move:
    the buffer's share, which the staging copy takes whole, and its direct leaves."""

    __slots__ = ("copied_nbytes", "direct", "direct_leaves", "direct_only", "has_direct",
                 "has_staged", "leaves", "logical_nbytes", "nbytes", "spec", "wire_nbytes",
                 "write_runs")  # fmt: skip

    def __init__(
        self, spec: Any, nbytes: int, logical_nbytes: int, leaves: tuple[Leaf, ...]
    ) -> None:
        self.spec, self.nbytes, self.logical_nbytes = spec, nbytes, logical_nbytes
        self.leaves = leaves
        self.direct = tuple(leaf.direct for leaf in leaves)
        self.direct_leaves = tuple(i for i, leaf in enumerate(leaves) if leaf.direct)
        staged_end = max((x.offset + x.nbytes for x in leaves if not x.direct), default=0)
        direct_nbytes = sum(x.nbytes for x in leaves if x.direct)
        self.wire_nbytes = staged_end + direct_nbytes
        self.copied_nbytes = nbytes + direct_nbytes
        self.has_staged = not all(self.direct)
        self.has_direct = any(self.direct)
        # every tensor copied from the pinned memory where it lies, none pinned first, in
        # fewer bytes than a copy on a side stream of its own (DeviceLoader may hand such a
        # batch out as soon as it is read)
        self.direct_only = (
            self.has_direct and not self.has_staged and not any(x.pin for x in leaves)
            and self.wire_nbytes < SIDE_STREAM_BYTES
        )  # fmt: skip
        # {index of a run's first leaf: (its length, the leaf covering it)} for the runs
        # (see _Node) of tensors that cross as they are: one torch.stack writes each
        index = {id(leaf): i for i, leaf in enumerate(leaves)}
        self.write_runs = {
            index[id(node.children[start])]: (whole.shape[0], whole)
            for node in _nodes(spec)
            for start, whole in node.runs
            if whole.wire == whole.dtype
        }


def _view(buffer: torch.Tensor, leaf: Leaf, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """The leaf's place in ``buffer`` (its bytes from ``offset`` on) as a tensor of ``dtype``."""
    begin = offset + leaf.offset
    return buffer[begin : begin + leaf.nbytes].view(dtype).view(leaf.shape)
