"""How a batch becomes a ``PackPlan``: its structure walked, each tensor's codec and crossing
chosen (staged in the buffer, or copied from where it lies), and its place in the buffer.

``Planner`` plans batch after batch with one set of codecs and keeps the layouts it made;
``plan_pack`` and ``pack`` plan one batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.transfer.packing.codecs import (
    LOSSY_FLOATS,
    LossyFloat,
    codec_reads_values,
    wire_dtype,
)
from gpuflow.transfer.packing.spec import (
    ALIGN,
    Leaf,
    PackLayout,
    Ragged,
    _Node,
    _RaggedSpec,
    _StackSpec,
)
from gpuflow.transfer.packing.write import Packed, PackPlan, _bytes_as_they_lie

DIRECT_MIN_BYTES = 64 << 10  # pinned tensors this large skip the staging copy (DeviceLoader)
# Pageable tensors this large are pinned by torch's ``pin_memory()`` (its copy runs on torch's
# intra-op threads) and then copied directly, as ``.pin_memory().to(...)`` does; smaller ones
# are cheaper to stage beside the rest of their batch.
PIN_MIN_BYTES = 256 << 10
_LONE_DIRECT = "lone pinned tensor direct"  # a signature's mark: Planner.plan_in_full


class Crossing(IntEnum):
    """How one tensor of a batch crosses to the device (recorded in its ``Leaf`` as
    ``direct`` and ``pin``)."""

    STAGED = 0  # written into the batch's staging buffer, crossing with the rest of it
    DIRECT = 1  # copied from the pinned memory where it lies into a device tensor of its own
    PINNED_FIRST = 2  # pageable: pinned by ``pin_memory()`` first, then copied like DIRECT


class Planner:
    """Plans batches one after another with one set of codecs (what ``plan_pack`` does once).

    A batch that is a tensor, or a dict, list or tuple of tensors (nested), is planned by a
    quick walk over its tensors' dtypes and shapes (and, for integers that narrow, their
    range), whose result picks a ``PackLayout`` made before for a batch of that signature: a
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
        # the batch being planned: each leaf placed so far, with the host data that fills it
        self.placed: list[tuple[Leaf, torch.Tensor | list[torch.Tensor]]] = []
        self.layouts: dict[tuple[Any, ...], PackLayout] = {}

    def plan_pack(
        self, batch: Any, lone_direct_over: int | None = None, pinned: bool = False
    ) -> PackPlan:
        """``batch`` measured and laid out; nothing is copied yet. With ``lone_direct_over``,
        in a batch of more bytes than that, a pinned tensor that would be the only one staged,
        beside tensors copied where they lie, is copied where it lies too
        (``plan_in_full``). ``pinned``: every tensor in the batch's dicts, lists and tuples
        is pinned (DataLoader's pin thread pins them all), so none is asked: asking costs
        the training thread host time on every batch (docs/decisions/042)."""
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
            at = [i for i, (leaf, _) in enumerate(self.placed) if not leaf.direct]
            staged = [(self.placed[i][1], self.placed[i][0].wire) for i in at]
            tensors, wire = len(self.placed), plan.wire_nbytes
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
        self.placed = []
        spec = self.plan_batch(batch)
        leaves = tuple(leaf for leaf, _ in self.placed)
        layout = PackLayout(spec, self.offset, self.logical, leaves)
        return PackPlan(layout, tuple(source for _, source in self.placed))

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
        tensor, on_wire = staged[0]
        return (
            isinstance(tensor, torch.Tensor)
            and on_wire == tensor.dtype
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
            if obj.requires_grad:  # as ``plan`` takes it: its values
                obj = obj.detach()
            order = _memory_order(obj)
            if order is not None:
                obj = obj.permute(order)  # contiguous: stored in its memory order
            wire = wire_dtype(obj, self.narrow, self.lossy)
            crossing = self._crossing(obj, wire, pinned)
            signature.append((obj.dtype, obj.shape, wire, crossing, order))
            sources.append(obj)
            if crossing is Crossing.STAGED:
                staged.append((obj, wire))
            return True
        if kind is dict:
            # the keys' types too: 1, 1.0 and True are equal keys, but not the same batch
            signature.append(("dict", *obj, *map(type, obj)))
            return all(
                self._walk(value, signature, sources, staged, pinned) for value in obj.values()
            )
        if kind is list or kind is tuple:
            # stacked, which needs a copy per batch anyway; or ragged, whose layout depends on
            # its lengths (sequences all empty walk as a nest of nothing)
            if _same_shape_tensors(obj) or _looks_ragged(obj):
                return False
            signature.append((kind, len(obj)))
            return all(self._walk(item, signature, sources, staged, pinned) for item in obj)
        return False

    def _crossing(self, tensor: torch.Tensor, wire: torch.dtype, pinned: bool = False) -> Crossing:
        """How ``tensor`` crosses: ``DIRECT`` when it is pinned and large enough that staging
        would only add a host copy; ``PINNED_FIRST`` when it is pageable and
        ``PIN_MIN_BYTES`` or more; else ``STAGED``. The driver's own asynchronous copy from
        pageable memory is slower than a staged one, so pageable memory is never its source
        (docs/decisions/018). ``pinned``: the tensor is known to be pinned, so it is not
        asked."""
        if (
            not self.direct
            or wire != tensor.dtype
            or tensor.nbytes < DIRECT_MIN_BYTES
            or not _bytes_as_they_lie(tensor)
        ):
            return Crossing.STAGED
        if pinned or tensor.is_pinned():
            return Crossing.DIRECT
        return Crossing.PINNED_FIRST if tensor.nbytes >= PIN_MIN_BYTES else Crossing.STAGED

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
            check_numeric_array(obj, "a NumPy array in the batch")
            # (ascontiguousarray would turn a 0-d array into a 1-d one)
            obj = torch.from_numpy(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_nested:
                raise GpuflowError(
                    f"a {obj.layout} tensor{' (nested)' if obj.is_nested else ''} cannot be "
                    "packed: only dense tensors can; pass .to_dense() (or .values() and "
                    "indices as their own tensors), or move it with .to() yourself"
                )
            if obj.device.type == "meta":
                raise GpuflowError(
                    "a meta tensor holds no data to move (it has a shape and no values); make "
                    "it on the cpu or the device instead"
                )
            if obj.requires_grad:  # a batch is data: its values cross, not its graph
                obj = obj.detach()
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
        if _hides_data(obj):
            raise GpuflowError(
                f"a {type(obj).__name__} in the batch holds tensors or arrays, and gpuflow packs "
                "them only in dicts, lists, tuples and dataclasses, so they would stay on the "
                "host; give them in one of those"
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
        if any(t.requires_grad for t in items):  # (stacked with out=, which autograd refuses)
            items = type(items)(t.detach() for t in items)
        first = items[0]
        stacked_shape = (len(items), *first.shape)
        if codec_reads_values(first.dtype, self.narrow, self.lossy):
            # the codec must see every value: stack once, check, convert
            source: torch.Tensor | list[torch.Tensor] = torch.stack(list(items))
            wire = wire_dtype(source, self.narrow, self.lossy)
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
        wire = wire_dtype(tensor, self.narrow, self.lossy)
        forced = len(self.placed) == self._forced_index  # (plan_in_full's lone tensor)
        crossing = Crossing.DIRECT if forced else self._crossing(tensor, wire)
        back = None if order is None else tuple(order.index(d) for d in range(len(order)))
        return self._place(tuple(tensor.shape), wire, tensor.dtype, tensor, crossing, back)

    def _place(
        self,
        shape: tuple[int, ...],
        wire: torch.dtype,
        dtype: torch.dtype,
        source: torch.Tensor | list[torch.Tensor],
        crossing: Crossing = Crossing.STAGED,
        order: tuple[int, ...] | None = None,
    ) -> Leaf:
        numel = math.prod(shape)
        nbytes = numel * wire.itemsize
        if crossing is Crossing.STAGED:
            leaf = Leaf(self.offset, nbytes, shape, wire, dtype, order=order)
            self.offset = round_up(self.offset + leaf.nbytes, ALIGN)
        else:  # takes no room in the buffer
            pin = crossing is Crossing.PINNED_FIRST
            leaf = Leaf(0, nbytes, shape, wire, dtype, direct=True, pin=pin, order=order)
        self.logical += numel * dtype.itemsize
        self.placed.append((leaf, source))
        return leaf


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


def check_numeric_array(array: np.ndarray, what: str) -> None:
    """Refuse, in words, a NumPy array torch cannot take: values that are not numbers (object,
    str, datetime) or numbers stored in the other byte order (from a file, a '>i4' dtype);
    ``what`` names it in the error."""
    if array.dtype.kind not in "biufc":
        raise GpuflowError(
            f"{what} holds {array.dtype} values, not numbers (only numbers can be moved); "
            "encode them as numbers first (class names as integer ids, dates as integers)"
        )
    if not array.dtype.isnative:
        raise GpuflowError(
            f"{what} is stored in the other byte order ({array.dtype.str}); give "
            "array.astype(array.dtype.newbyteorder('=')) instead"
        )


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
    """Two or more contiguous host tensors of one dtype and shape: worth packing as one
    stacked leaf (the stack is contiguous: others go one by one, to keep their strides).

    This runs once per item of every list, so it uses only the cheapest attribute reads.
    """
    if len(items) < 2 or not isinstance(items[0], torch.Tensor) or not items[0].is_cpu:
        return False
    dtype, shape = items[0].dtype, items[0].shape
    return all(
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.shape == shape
        and t.is_cpu
        and t.is_contiguous()
        for t in items
    )


_HIDING_DEPTH = 3  # how deep a set, deque or object's attributes are searched for data


def _hides_data(obj: Any, depth: int = _HIDING_DEPTH) -> bool:
    """Whether ``obj`` is a set, a deque or an object with attributes (a namespace, say)
    holding a tensor or array, within ``depth`` levels: a container ``plan`` does not open."""
    attributes = getattr(obj, "__dict__", None)
    if isinstance(obj, set | frozenset | deque):
        items: Any = obj
    elif isinstance(attributes, dict) and not isinstance(obj, type):
        items = attributes.values()
    else:
        return False
    return any(
        isinstance(item, torch.Tensor | np.ndarray) or (depth > 1 and _hides_data(item, depth - 1))
        for item in items
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
