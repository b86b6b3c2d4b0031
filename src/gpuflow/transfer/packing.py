"""Coalesce a whole batch into one buffer, cross the bus once, rebuild it on the device.

``pack`` lays every tensor of a nested batch (dicts, lists, tuples, namedtuples, dataclasses,
``Ragged`` integer sequences) end to end in one host buffer, narrowing on the way; ``unpack``
turns one device copy of that buffer back into the same structure, as views of it. Codecs:
integer narrowing (on by default, range-checked on every batch) and ``lossy_float`` (opt-in);
uint8 and bool cross as they are.

Why one copy, what each codec does, and what is passed through or refused:
docs/architecture/transfer-pipeline.md (Packing a batch into one buffer).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.device.accelerator import Device

ALIGN = 16  # bytes: every view aligned for any dtype and for 16-byte vector loads
LOSSY_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One codec for every float tensor, or one per top-level key of a mapping batch.
LossyFloat = str | Mapping[str, str | None] | None
_FLOAT_SOURCES = (torch.float32, torch.float64)
_NARROWABLE = (torch.int64, torch.int32)
_MEMMOVE_MAX_BYTES = 256 << 10  # beyond this torch's copy (threaded, lock released) is faster
DIRECT_MIN_BYTES = 64 << 10  # pinned tensors this large skip the staging copy (DeviceLoader)
# Pageable tensors this large are pinned by torch's ``pin_memory()`` (its copy runs on torch's
# intra-op threads) and then copied directly, as ``.pin_memory().to(...)`` does; smaller ones
# are cheaper to stage beside the rest of their batch.
PIN_MIN_BYTES = 256 << 10
SIDE_STREAM_BYTES = 4 << 20  # copies this large overlap compute on a stream of their own
_UINT16_MAX = 65535


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
        arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        lengths = [a.size for a in arrays]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(torch.from_numpy(values), torch.from_numpy(offsets), tuple(offsets.tolist()))

    def __len__(self) -> int:
        return len(self.host_offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        start, end = self.host_offsets[i], self.host_offsets[i + 1]
        return self.values[start:end]

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


_MIN_RUN = 4  # children in a run: fewer are cheaper one by one


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


class Layout:
    """Where each tensor of a batch goes in the packed buffer, and the spec to rebuild it:
    everything about a plan except the tensors themselves. Batches of one structure, shapes
    and codecs share one ``Layout`` (see ``Planner``), which lets a loader rebuild a run of
    them at once.

    ``nbytes`` is the buffer's share (staged leaves, alignment padding included);
    ``wire_nbytes`` every byte of the batch that crosses the bus, direct leaves included."""

    __slots__ = ("direct", "direct_leaves", "direct_only", "has_direct", "has_staged", "leaves",
                 "logical_nbytes", "nbytes", "spec", "wire_nbytes", "write_runs")  # fmt: skip

    def __init__(
        self, spec: Any, nbytes: int, logical_nbytes: int, leaves: tuple[Leaf, ...]
    ) -> None:
        self.spec, self.nbytes, self.logical_nbytes = spec, nbytes, logical_nbytes
        self.leaves = leaves
        self.direct = tuple(leaf.direct for leaf in leaves)
        self.direct_leaves = tuple(i for i, leaf in enumerate(leaves) if leaf.direct)
        staged_end = max((x.offset + x.nbytes for x in leaves if not x.direct), default=0)
        self.wire_nbytes = staged_end + sum(x.nbytes for x in leaves if x.direct)
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


class PackPlan:
    """A batch measured and laid out, ready to be written into any buffer of ``nbytes``:
    its ``Layout`` and, leaf by leaf, the host tensor (or list of same-shape tensors to
    stack) that fills it."""

    __slots__ = ("layout", "sources")

    def __init__(self, layout: Layout, sources: tuple[Any, ...]) -> None:
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
        """Bytes of the batch itself on the wire: staged and direct tensors, no padding."""
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
        thread of its own the same copy took three times as long: docs/decisions/041)."""
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


@dataclass(frozen=True)
class Packed:
    """A batch coalesced into ``buffer[:nbytes]``; ``spec`` says how to rebuild it."""

    buffer: torch.Tensor
    nbytes: int
    logical_nbytes: int
    spec: Any


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


def _view(buffer: torch.Tensor, leaf: Leaf, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    begin = offset + leaf.offset
    return buffer[begin : begin + leaf.nbytes].view(dtype).view(leaf.shape)


def _check_range(tensor: torch.Tensor, codec: torch.dtype) -> None:
    """Refuse a finite value beyond ``codec``'s range, which would cross as inf (an inf or
    NaN already there crosses as itself). One pass in the common case."""
    limit = torch.finfo(codec).max
    low, high = (float(v) for v in torch.aminmax(tensor))
    if -limit <= low and high <= limit:
        return
    peak = float(torch.where(torch.isfinite(tensor), tensor.abs(), 0).max())
    if peak > limit:
        name = "fp16" if codec == torch.float16 else "bf16"
        other = "use lossy_float='bf16'" if name == "fp16" else "send it as it is (no lossy_float)"
        raise GpuflowError(
            f"a float tensor holds {peak:.4g}, beyond {name}'s range ({limit:.4g}); it would "
            f"cross as inf: {other}"
        )


_OR_MAX_NUMEL = 1 << 20  # beyond this torch's threaded aminmax beats one thread's OR


def _narrowed_by_or(tensor: torch.Tensor) -> torch.dtype | None:
    """The narrow dtype of the integer ``tensor`` when one bitwise OR over all its values
    settles it: none negative (a negative one sets the sign bit) and all within uint16, or
    all within int32; None when it does not (a negative value, a large or
    strided tensor), for ``aminmax`` to decide. One pass over the values, where ``aminmax``
    was the largest host cost of a narrowed batch of token ids (docs/decisions/037)."""
    if not tensor.is_contiguous() or tensor.numel() > _OR_MAX_NUMEL:
        return None
    whole = int(np.bitwise_or.reduce(tensor.detach().numpy().reshape(-1)))
    if 0 <= whole <= _UINT16_MAX:
        return torch.uint16
    if 0 <= whole < 2**31:
        return torch.int32  # (an int32 tensor's own dtype: it crosses as it is)
    return None


def _memory_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """For a tensor that is dense but not contiguous (channels_last, a transpose): the
    permutation of its dimensions that is contiguous, so it can be stored as its memory lies
    and arrive with its strides. None for a contiguous tensor, or one with gaps (stored
    contiguous)."""
    if tensor.is_contiguous() or tensor.dim() < 2:
        return None
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))
    return order if tensor.permute(order).is_contiguous() else None


def _mapping_type(obj: Mapping) -> Callable[[Any], Mapping]:
    """The mapping's own type when it can be built from key-value pairs (a defaultdict with
    its factory), else dict."""
    if isinstance(obj, defaultdict):
        factory = obj.default_factory
        return lambda pairs: type(obj)(factory, pairs)
    try:
        type(obj)([])
    except TypeError:
        return dict
    return type(obj)


def _is_int_sequence(item: Any) -> bool:
    return isinstance(item, list | tuple) and all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in item
    )


def _same_shape_tensors(items: list[Any] | tuple[Any, ...]) -> bool:
    """Two or more host tensors of one dtype and shape: worth packing as one stacked leaf.

    This runs once per item of every list, so it uses only the cheapest attribute reads.
    """
    if len(items) < 2 or not isinstance(items[0], torch.Tensor) or not items[0].is_cpu:
        return False
    dtype, shape = items[0].dtype, items[0].shape
    return all(
        isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape and t.is_cpu
        for t in items
    )


def _looks_ragged(obj: Any) -> bool:
    """A non-empty list/tuple of integer lists: ragged token sequences, say. Empty ones
    count too, so that a batch whose sequences all happen to be empty is still ragged."""
    return (
        isinstance(obj, list | tuple)
        and not hasattr(obj, "_fields")  # a namedtuple is a record, whatever it holds
        and len(obj) > 0
        and all(isinstance(item, list | tuple) for item in obj)
        and all(_is_int_sequence(item) for item in obj)
    )


_LONE_DIRECT = "lone pinned tensor direct"  # a signature's mark: Planner.plan_in_full


class Planner:
    """Plans batches one after another with one set of codecs (what ``plan_pack`` does once).

    A batch that is a tensor, or a dict, list or tuple of tensors (nested), is planned by a
    quick walk over its tensors' dtypes and shapes (and, for integers that narrow, their
    range), whose result picks a ``Layout`` made before for a batch of that signature: a
    stream of like batches is laid out once, not once per batch. Other batches are planned
    in full each time.
    """

    _CACHED_LAYOUTS = 64  # signatures kept; a source of ever-new shapes starts over

    def __init__(self, narrow: bool, lossy_float: LossyFloat, direct: bool = False) -> None:
        by_key = dict(lossy_float) if isinstance(lossy_float, Mapping) else None
        for codec in by_key.values() if by_key is not None else [lossy_float]:
            if codec is not None and codec not in LOSSY_FLOATS:
                raise GpuflowError(
                    f"lossy_float must be one of {sorted(LOSSY_FLOATS)} or None (or a dict of "
                    f"them by the batch's keys), got {codec!r}"
                )
        self.narrow = narrow
        self.by_key = by_key  # codecs by top-level key, or None: one codec for the batch
        self.lossy = None if by_key is not None else LOSSY_FLOATS.get(lossy_float or "")
        self.offset = 0
        self.logical = 0
        self.direct = direct
        self._forced_index: int | None = None  # the leaf plan_in_full sends direct, by position
        self.layout: list[tuple[Leaf, torch.Tensor | list[torch.Tensor]]] = []
        self.layouts: dict[tuple[Any, ...], Layout] = {}

    def plan_pack(
        self, batch: Any, lone_direct_over: int | None = None, pinned: bool = False
    ) -> PackPlan:
        """``batch`` measured and laid out; nothing is copied yet. With ``lone_direct_over``,
        in a batch of more bytes than that, a pinned tensor that would be the only one staged,
        beside tensors copied where they lie, is copied where it lies too
        (``plan_in_full``). ``pinned``: every tensor in the batch's dicts, lists and tuples
        is pinned (DataLoader's pin thread pins them all), so none is asked: while that
        thread runs, asking cost the image loop's training thread about 80 us a batch
        (docs/decisions/042)."""
        signature: list[Any] | None = None
        sources: list[Any] = []
        if self.by_key is None:
            signature, staged = [], []
            # (pinned for the walk only: a full plan asks each tensor)
            walked = self._walk(batch, signature, sources, staged, pinned)
            if walked and lone_direct_over is not None and len(staged) == 1:
                wire = sum(source.nbytes for source in sources)  # (the lone one unchanged)
                if self._lone_staged(staged, len(sources), wire, lone_direct_over, pinned):
                    signature.append(_LONE_DIRECT)
            if walked:
                layout = self.layouts.get(tuple(signature))
                if layout is not None:
                    return PackPlan(layout, tuple(sources))
            else:
                signature = None
        plan = self.plan_in_full(batch, lone_direct_over)
        if signature is not None:
            if len(self.layouts) >= self._CACHED_LAYOUTS:
                self.layouts.clear()
            self.layouts[tuple(signature)] = plan.layout
        return plan

    def plan_in_full(self, batch: Any, lone_direct_over: int | None = None) -> PackPlan:
        """``batch`` planned from scratch, without looking for a layout made before.

        With ``lone_direct_over``: staging exists to gather small tensors into one copy, and
        batches of more bytes than that cross alone, gathering no other batch's. So such a
        batch whose tensors all cross where they lie but one small pinned one that crosses
        unchanged (an image and its labels, pinned by DataLoader's thread) copies that one
        where it lies as well: staging it alone would cost a host copy, a staging buffer and
        an event, and gather nothing (docs/decisions/042)."""
        plan = self._plan_once(batch)
        if lone_direct_over is not None:
            at = [i for i, (leaf, _) in enumerate(self.layout) if not leaf.direct]
            staged = [(self.layout[i][1], self.layout[i][0].wire) for i in at]
            tensors, wire = len(self.layout), plan.wire_nbytes
            if self._lone_staged(staged, tensors, wire, lone_direct_over):
                # by position: a tensor stored in its memory order is a new view each time
                self._forced_index = at[0]
                try:
                    plan = self._plan_once(batch)
                finally:
                    self._forced_index = None
        return plan

    def _plan_once(self, batch: Any) -> PackPlan:
        self.offset = self.logical = 0
        self.layout = []
        spec = self.plan_batch(batch)
        layout = Layout(spec, self.offset, self.logical, tuple(leaf for leaf, _ in self.layout))
        return PackPlan(layout, tuple(source for _, source in self.layout))

    def _lone_staged(
        self, staged: list[tuple[Any, torch.dtype]], tensors: int, wire: int, over: int | None,
        pinned: bool = False,
    ) -> bool:  # fmt: skip
        """Whether a batch of more than ``over`` bytes (``wire``) whose tensors (two at
        least) all cross where they lie but one staged has that one pinned (known to be, with
        ``pinned``) and crossing as its bytes lie (unchanged, contiguous, no conjugate or
        negative bit)."""
        if not self.direct or over is None or wire <= over or len(staged) != 1 or tensors < 2:
            return False
        tensor, wire_dtype = staged[0]
        return (
            isinstance(tensor, torch.Tensor)
            and wire_dtype == tensor.dtype
            and _bytes_as_they_lie(tensor)
            and (pinned or tensor.is_pinned())
        )

    def _walk(
        self, obj: Any, signature: list[Any], sources: list[Any], staged: list, pinned: bool
    ) -> bool:
        """Append ``obj``'s signature and host tensors (and to ``staged`` those staged, with
        their wire dtype); False if it is not a nest of plain host tensors in dicts, lists and
        tuples (then it is planned in full). ``pinned``: its tensors are known to be."""
        kind = type(obj)
        if kind is torch.Tensor:
            if not obj.is_cpu or obj.layout != torch.strided or obj.is_nested:
                return False
            order = _memory_order(obj)
            if order is not None:
                obj = obj.permute(order)  # contiguous: stored in its memory order
            wire = self._wire_dtype(obj)
            direct = self._direct_kind(obj, wire, pinned)
            signature.append((obj.dtype, obj.shape, wire, direct, order))
            sources.append(obj)
            if not direct:
                staged.append((obj, wire))
            return True
        if kind is dict:
            signature.append(("dict", *obj))
            return all(
                self._walk(value, signature, sources, staged, pinned) for value in obj.values()
            )
        if kind is list or kind is tuple:
            if _same_shape_tensors(obj):  # stacked, which needs a copy per batch anyway
                return False
            signature.append((kind, len(obj)))
            return all(self._walk(item, signature, sources, staged, pinned) for item in obj)
        return False

    def _direct_kind(self, tensor: torch.Tensor, wire: torch.dtype, pinned: bool = False) -> int:
        """How ``tensor`` crosses: 0 staged; 1 copied from where it lies (pinned, and large
        enough that staging would only add a host copy); 2 pinned by ``pin_memory()`` first
        (pageable and ``PIN_MIN_BYTES`` or more), then copied like 1. (The driver's own
        asynchronous copy from pageable memory ran at 7-8 GB/s on an H100 host, a quarter of
        a staged one, so pageable memory is never its source; docs/decisions/018.)
        ``pinned``: the tensor is known to be pinned, so it is not asked."""
        if (
            not self.direct
            or wire != tensor.dtype
            or tensor.nbytes < DIRECT_MIN_BYTES
            or not _bytes_as_they_lie(tensor)
        ):
            return 0
        if pinned or tensor.is_pinned():
            return 1
        return 2 if tensor.nbytes >= PIN_MIN_BYTES else 0

    def plan_batch(self, batch: Any) -> Any:
        """``plan`` with the codecs chosen per top-level key, when they are."""
        if self.by_key is None:
            return self.plan(batch)
        if not isinstance(batch, Mapping):
            raise GpuflowError(
                f"lossy_float by key needs a batch that is a mapping; got {type(batch).__name__}"
            )
        missing = [k for k in self.by_key if k not in batch]
        if missing:
            raise GpuflowError(
                f"lossy_float names {missing[0]!r}, which the batch does not have (its keys: "
                f"{', '.join(map(str, batch))})"
            )
        keys = tuple(batch)
        children = []
        for key in keys:
            self.lossy = LOSSY_FLOATS.get(self.by_key.get(key) or "")
            children.append(self.plan(batch[key]))
        self.lossy = None
        return _Node.of(_mapping_type(batch), tuple(children), keys)

    def plan(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            # (ascontiguousarray would turn a 0-d array into a 1-d one)
            obj = torch.from_numpy(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_nested:
                raise GpuflowError(
                    f"a {obj.layout} tensor{' (nested)' if obj.is_nested else ''} cannot be "
                    "packed: only dense tensors can; pass .to_dense() (or .values() and "
                    "indices as their own tensors), or move it with .to() yourself"
                )
            return obj if obj.device.type != "cpu" else self._leaf(obj)
        if isinstance(obj, Ragged):
            return self._ragged(obj)
        if isinstance(obj, Mapping):
            keys = tuple(obj)
            return _Node.of(_mapping_type(obj), tuple(self.plan(obj[k]) for k in keys), keys)
        if _looks_ragged(obj):
            return self._ragged(Ragged.from_sequences(obj))
        if isinstance(obj, list | tuple):  # namedtuples too
            if not hasattr(obj, "_fields") and _same_shape_tensors(obj):
                return self._stack(obj)
            return _Node.of(type(obj), tuple(map(self.plan, obj)))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._dataclass(obj)
        if hasattr(obj, "to") or hasattr(obj, "pin_memory"):
            raise GpuflowError(
                f"a {type(obj).__name__} has .to() but is not a tensor, array or container "
                "gpuflow can pack, so it would stay on the host; give its tensors in a dict, "
                "list, tuple or dataclass"
            )
        return obj  # str, int, float, None...: not data to move

    def _dataclass(self, obj: Any) -> _Node:
        fields = dataclasses.fields(obj)
        if not all(f.init for f in fields):
            raise GpuflowError(
                f"{type(obj).__name__} has fields outside __init__, so it cannot be rebuilt "
                "on the device; give its tensors in a dict or a plain dataclass"
            )
        keys = tuple(f.name for f in fields)
        children = tuple(self.plan(getattr(obj, k)) for k in keys)
        return _Node.of(type(obj), children, keys, keywords=True)

    def _stack(self, items: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> _StackSpec:
        first = items[0]
        stacked_shape = (len(items), *first.shape)
        needs_check = (self.narrow and first.dtype in _NARROWABLE) or (
            self.lossy is not None and first.dtype in _FLOAT_SOURCES
        )
        if needs_check:  # the codec must see every value: stack once, check, convert
            source: torch.Tensor | list[torch.Tensor] = torch.stack(list(items))
            wire = self._wire_dtype(source)
        else:
            source, wire = list(items), first.dtype
        leaf = self._place(stacked_shape, wire, first.dtype, source)
        return _StackSpec(leaf, type(items))

    def _ragged(self, ragged: Ragged) -> _RaggedSpec:
        return _RaggedSpec(
            self._leaf(ragged.values), self._leaf(ragged.offsets), ragged.host_offsets
        )

    def _leaf(self, tensor: torch.Tensor) -> Leaf:
        order = _memory_order(tensor)
        if order is not None:
            tensor = tensor.permute(order)  # contiguous: stored in its memory order
        wire = self._wire_dtype(tensor)
        forced = len(self.layout) == self._forced_index  # (plan_in_full's lone tensor)
        kind = 1 if forced else self._direct_kind(tensor, wire)
        back = None if order is None else tuple(order.index(d) for d in range(len(order)))
        return self._place(tuple(tensor.shape), wire, tensor.dtype, tensor, kind, back)

    def _place(
        self,
        shape: tuple[int, ...],
        wire: torch.dtype,
        dtype: torch.dtype,
        source: torch.Tensor | list[torch.Tensor],
        direct_kind: int = 0,
        order: tuple[int, ...] | None = None,
    ) -> Leaf:
        numel = math.prod(shape)
        if direct_kind:  # takes no room in the buffer
            leaf = Leaf(0, numel * wire.itemsize, shape, wire, dtype, True, direct_kind == 2, order)
        else:
            leaf = Leaf(self.offset, numel * wire.itemsize, shape, wire, dtype, order=order)
            self.offset = round_up(self.offset + leaf.nbytes, ALIGN)
        self.logical += numel * dtype.itemsize
        self.layout.append((leaf, source))
        return leaf

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        dtype = tensor.dtype
        if self.narrow and dtype in _NARROWABLE and tensor.numel():
            known = _narrowed_by_or(tensor)
            if known is not None:
                return known
            low, high = (int(v) for v in torch.aminmax(tensor))
            if low >= 0 and high <= _UINT16_MAX:
                return torch.uint16
            if dtype == torch.int64 and low >= -(2**31) and high < 2**31:
                return torch.int32
        if self.lossy is not None and dtype in _FLOAT_SOURCES:
            if tensor.numel():
                _check_range(tensor, self.lossy)
            return self.lossy
        return dtype


def plan_pack(
    batch: Any,
    *,
    narrow: bool = True,
    lossy_float: LossyFloat = None,
    direct: bool = False,
) -> PackPlan:
    """Measure ``batch`` and choose each tensor's codec; nothing is copied yet.

    With ``direct``, pinned tensors of ``DIRECT_MIN_BYTES`` or more that cross unchanged are
    marked to be copied straight from where they are into device tensors of their own
    (``PackPlan.direct_pairs``; ``rebuild`` takes them): staging them would only add a host
    copy. So are pageable ones of ``PIN_MIN_BYTES`` or more, marked ``pin``: the copier pins
    them first.
    """
    return Planner(narrow, lossy_float, direct).plan_in_full(batch)  # (no later batch to share)


def pack(
    batch: Any,
    out: torch.Tensor | None = None,
    *,
    narrow: bool = True,
    lossy_float: LossyFloat = None,
    pin_memory: bool = False,
) -> Packed:
    """Coalesce ``batch`` into one host buffer (``out`` if given, else a new one)."""
    plan = plan_pack(batch, narrow=narrow, lossy_float=lossy_float)
    if out is None:
        out = torch.empty(max(plan.nbytes, 1), dtype=torch.uint8, pin_memory=pin_memory)
    plan.write_into(out)
    return Packed(out, plan.nbytes, plan.logical_nbytes, plan.spec)


def rebuild(
    buffer: torch.Tensor | None, spec: Any, direct: Iterator[torch.Tensor] | None = None
) -> Any:
    """The batch described by ``spec`` from ``buffer`` (already where it should be).

    Tensors that crossed unchanged are views of ``buffer``; narrowed or compressed ones are
    converted back, which queues one small kernel each on the current stream. Direct leaves
    are taken, in order, from ``direct``.
    """
    if isinstance(spec, Leaf):
        if spec.direct:
            return spec.delivered(next(direct))  # type: ignore[arg-type]
        view = _view(buffer, spec, spec.wire)  # type: ignore[arg-type]
        return spec.delivered(view if spec.wire == spec.dtype else view.to(spec.dtype))
    if isinstance(spec, _StackSpec):
        return spec.kind(rebuild(buffer, spec.leaf).unbind(0))
    if isinstance(spec, _RaggedSpec):
        values = rebuild(buffer, spec.values, direct)
        return Ragged(values, rebuild(buffer, spec.offsets, direct), spec.host_offsets)
    if isinstance(spec, _Node):
        return spec.build(
            spec.items(
                lambda child: rebuild(buffer, child, direct),
                lambda whole: list(rebuild(buffer, whole).unbind(0)),
            )
        )
    return spec


def rebuild_run(
    buffer: torch.Tensor | None, spec: Any, offset: int, stride: int, n: int,
    direct: list[Iterator[torch.Tensor]] | None = None,
) -> list[Any]:  # fmt: skip
    """The ``n`` batches of one layout (``spec``) laid ``stride`` bytes apart from ``offset``
    in ``buffer``: one strided view (and one conversion, if narrowed) per leaf for the whole
    run, instead of a view per leaf per batch. ``buffer``'s length must be a multiple of 16
    and ``offset`` and ``stride`` multiples of ``ALIGN``. Batch ``i``'s direct leaves are
    taken, in order, from ``direct[i]``."""
    if isinstance(spec, Leaf):
        if spec.direct:
            return [spec.delivered(next(tensors)) for tensors in direct]  # type: ignore[union-attr]
        assert buffer is not None
        size = spec.wire.itemsize
        strides, step = [], 1
        for extent in reversed(spec.shape):
            strides.append(step)
            step *= extent
        run = buffer.view(spec.wire).as_strided(
            (n, *spec.shape), (stride // size, *reversed(strides)), (offset + spec.offset) // size
        )  # (n, *shape): batch i's tensor at run[i]
        if spec.wire != spec.dtype:
            run = run.to(spec.dtype)  # one widening kernel for the whole run
        if spec.order is not None:
            run = run.permute(0, *(d + 1 for d in spec.order))
        return list(run.unbind(0))
    if isinstance(spec, _StackSpec):
        return [spec.kind(t.unbind(0)) for t in rebuild_run(buffer, spec.leaf, offset, stride, n)]
    if isinstance(spec, _RaggedSpec):
        values = rebuild_run(buffer, spec.values, offset, stride, n, direct)
        offsets = rebuild_run(buffer, spec.offsets, offset, stride, n, direct)
        return [Ragged(v, o, spec.host_offsets) for v, o in zip(values, offsets, strict=True)]
    if isinstance(spec, _Node):
        columns = spec.items(
            lambda child: rebuild_run(buffer, child, offset, stride, n, direct),
            lambda whole: _run_columns(rebuild_run(buffer, whole, offset, stride, n)),
        )
        return [spec.build(list(row)) for row in zip(*columns, strict=True)]
    return [spec] * n  # a value that is not data to move


def _run_columns(stacked: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A run's (count, *shape) tensor of each of n batches as count columns of n tensors."""
    return [list(column) for column in zip(*(t.unbind(0) for t in stacked), strict=True)]


def unpack(
    packed: Packed, device: Device | torch.device | str | int, non_blocking: bool = True
) -> Any:
    """One copy of ``packed`` to ``device``, then the batch rebuilt there.

    ``non_blocking`` only helps when ``packed.buffer`` is pinned; the caller must keep the
    host buffer unchanged until the copy completes (``DeviceLoader`` does this with events).
    """
    target = device if isinstance(device, torch.device) else Device.resolve(device).torch
    try:
        on_device = packed.buffer[: packed.nbytes].to(target, non_blocking=non_blocking)
    except (AssertionError, RuntimeError):
        # A torch.device is taken as it is, unchecked on the way (once a batch); a copy that
        # fails is checked here, so a device this machine lacks is one line, as elsewhere.
        try:
            if target.type != "meta":
                Device.resolve(target)
        except GpuflowError as missing:
            raise missing from None
        raise
    return rebuild(on_device, packed.spec)
