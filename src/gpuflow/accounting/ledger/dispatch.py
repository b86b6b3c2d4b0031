"""Which torch operations a ledger counts, and how: the kernels registered for them at the
dispatcher, the mode that stands in for them in inference mode, and the events each one makes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpuflow.accounting import tally
from gpuflow.accounting.ledger.frames import (
    _inside_the_compiler,
    _reads_device_data,
    caller_location,
)
from gpuflow.accounting.ledger.records import OpenLedger, TransferEvent
from gpuflow.accounting.ledger.threads import _counting_now, _ledgers_here, _state

# Operations whose result size depends on device data: the host waits for the device.
_aten = torch.ops.aten
_ITEM = _aten._local_scalar_dense.default
_TO_COPY = _aten._to_copy.default
_COPY = _aten.copy_.default
# torch.tensor of Python data: the host-to-device copy inside is made with the counting
# key excluded; the fresh tensor then passes through lift_fresh, on the device.
_LIFT_FRESH = _aten.lift_fresh.default
_DATA_DEPENDENT = {
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.repeat_interleave.Tensor: "repeat_interleave without output_size",
}
_MASK_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default}
# Every other operation passes the counter's dispatch key in C++, unseen.
_WATCHED = {_ITEM, _TO_COPY, _COPY, _LIFT_FRESH, *_DATA_DEPENDENT, *_MASK_INDEXING}
# The counting kernels' key: the one below autograd where view and in-place ops update
# their metadata, which every other watched operation passes straight through. Operations
# a torch operation makes inside itself run with it excluded, unseen and uncharged.
_KEY = torch._C.DispatchKey.ADInplaceOrView
# Two watched operations never reach that key: torch.tensor(data, device=...) passes its new
# tensor through lift_fresh with the key excluded, and autograd's kernel for
# repeat_interleave.Tensor goes straight below it. They are watched at the backend-select
# key instead, which nothing excludes.
_REPEAT_INTERLEAVE = _aten.repeat_interleave.Tensor
_KEY_OF = {
    _LIFT_FRESH: torch._C.DispatchKey.BackendSelect,
    _REPEAT_INTERLEAVE: torch._C.DispatchKey.BackendSelect,
}
_PYTHON = torch._C.DispatchKey.Python
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
# Python modes that trace rather than run (torch.compile, torch.export): what they see is not
# an operation that runs.
_TRACING_MODES = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)
_IN_PLACE = {_COPY, _aten.index_put_.default}  # whose kernel at that key bumps the version
_COPIES = {_COPY, _TO_COPY}


# torch.compile converts every Python frame that starts while a compiled function runs, unless
# its file is on dynamo's skip list: the counting kernels that an operation run eagerly there
# calls (the `.item()` at a graph break), and the wrappers of the reads and waits, would be
# traced, read torch.compiler.is_compiling() as True, and count nothing. The accounting
# layer's files (the ledger's and the tally's) go on that list once dynamo has loaded it, which
# is before anything can be compiled; it is looked up, never imported here (a kernel may run
# while dynamo is being imported).
_OUT_OF_DYNAMO = ("gpuflow.accounting",)
_dynamo_told = False


def _keep_out_of_dynamo() -> None:
    global _dynamo_told
    add = getattr(sys.modules.get("torch._dynamo.trace_rules"), "add", None)
    if _dynamo_told or add is None:
        return
    for module in _OUT_OF_DYNAMO:
        add(module)
    _dynamo_told = True


def _emit(
    make: Callable[[OpenLedger], TransferEvent],
    ledgers: list[OpenLedger],
    host_only: bool = False,
) -> None:
    """Count one event in ``ledgers`` (``host_only``: in those of them that count the reads
    of host data, ``TransferLedger.host_reads``)."""
    if tally.in_housekeeping():  # the transfer layer's own clean-up: not the region's work
        return
    if _inside_the_compiler():
        return
    violation: Exception | None = None
    for ledger in list(ledgers):  # another thread (a backward's) may close one meanwhile
        if host_only and not ledger.host_reads:
            continue
        event = make(ledger)
        ledger._events.append(event)
        if ledger._watch is not None and violation is None:
            violation = ledger._watch(event)
    if violation is not None:  # raised at the operation itself, every ledger told first
        raise violation


def _record_reported(
    kind: str, nbytes: int, op: str, dtype: str | None, pinned: bool | None
) -> None:
    """A copy another thread made for this one (``gpuflow.accounting.tally``)."""
    where = caller_location()
    _emit(
        lambda ledger: TransferEvent(
            kind, op, where, ledger._step, nbytes=nbytes, dtype=dtype, pinned=pinned
        ),
        _state.ledgers,
    )


def _record_sync(op: str, ledgers: list[OpenLedger]) -> None:
    where = caller_location()
    _emit(lambda ledger: TransferEvent("sync", op, where, ledger._step), ledgers)


def _any_for_the_host(ledgers: list[OpenLedger]) -> bool:
    return any(ledger.host_reads for ledger in ledgers)


def _record_host_read(op: str, ledgers: list[OpenLedger]) -> None:
    """A read of a host tensor's data is what would make the host wait were the tensor on a
    GPU: ledgers for the cpu (on a machine without a GPU, "auto" is the cpu) count it as a
    sync, so that ``budget(syncs=0)`` fails there where the same code, its tensors on a GPU,
    would fail on one. A ledger for a GPU counts only real waits on it: reading a tensor the
    code keeps on the host waits for nothing there."""
    if _any_for_the_host(ledgers) and _reads_device_data():
        where = caller_location()
        label = f"{op} (would wait on a GPU)"
        _emit(lambda ledger: TransferEvent("sync", label, where, ledger._step), ledgers, True)


def _is_device(t: Any) -> bool:
    """Tensors off the host. Meta tensors count too, so the accounting can be exercised
    without an accelerator (a copy to meta moves nothing but is counted like one)."""
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _host_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


class _InferenceCounter(TorchDispatchMode):
    """Inference mode excludes the counting kernels' key, and tensors made in it lack it: while
    a ledger thread is in inference mode, this mode counts the watched operations instead,
    each operation there paying a Python call."""

    def __init__(self, ledgers: list[OpenLedger]) -> None:
        super().__init__()
        self.ledgers = ledgers

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code runs compiled under it, as with no mode at all

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_inference_mode_enabled():  # inference_mode(False) within: the kernels count
            return func(*args, **kwargs)
        if func in _WATCHED and self.ledgers and _counting_now():
            return _counted_operation(
                func, lambda: func(*args, **kwargs), args, kwargs, self.ledgers
            )
        # Without autograd's keys, torch's composite operations (item, to) arrive whole:
        # their parts come back here.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


# Python kernels are given a wrapped number (a Python scalar torch made into a tensor) as
# the number; the operation below needs the tensor back, of the dtype it was made with:
# torch's default for the scalar's type, or for a value indexing assigns, the dtype of the
# tensor it is written into.
_WRAPPED_DTYPES = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
    complex: torch.complex128,
}


_INDEXED_VALUES = {_aten.index_put_.default: 2, _aten.index_put.default: 2}


def _tensor_positions(op: Any) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(op._schema.arguments) if str(a.type) == "Tensor")


def _rewrapped(
    args: tuple[Any, ...], positions: tuple[int, ...], value_at: int | None
) -> tuple[tuple[Any, ...], bool]:
    """``args`` with their wrapped numbers made tensors again, and whether there were any."""
    out = None
    for i in positions:
        if i < len(args) and isinstance(args[i], (bool, int, float, complex)):
            out = out or list(args)
            like = args[0].dtype if i == value_at else _WRAPPED_DTYPES[type(args[i])]
            out[i] = torch.scalar_tensor(args[i], dtype=like)
    return (args, False) if out is None else (tuple(out), True)


def _traced(args: tuple[Any, ...]) -> bool:
    """Whether a Python mode or tensor subclass below traces the operation instead of running
    it. A user's own mode or subclass runs it, below the counter: it counts here, once."""
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES):
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return any(isinstance(a, (FakeTensor, FunctionalTensor)) for a in args)


def _counting_kernel(op: Any) -> Callable[..., Any]:
    """``op``'s kernel at ``_KEY`` while a ledger is open: it counts ``op`` for the ledgers of
    the thread it runs on, and does what the key's own kernel did: pass the operation on,
    and for an in-place one bump the tensor's version. Every watched operation of every
    thread comes here while a ledger is open: the way out for those not counted is short."""
    positions = _tensor_positions(op)
    value_at = _INDEXED_VALUES.get(op)
    below_key = torch._C._dispatch_keyset_full_after(_KEY_OF.get(op, _KEY))
    in_place = op in _IN_PLACE
    stays = _STAYS.get(op)  # a test that the operation can be neither a crossing nor a wait

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not _dynamo_told:
            _keep_out_of_dynamo()  # dynamo loaded since the ledger opened
        args, wrapped = _rewrapped(args, positions, value_at)
        below = keyset & below_key

        def run() -> Any:
            if not in_place:
                return op.redispatch(below, *args, **kwargs)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                op.redispatch(below, *args, **kwargs)
            written = args[0]
            if written.is_inference() and not torch.is_inference_mode_enabled():
                raise RuntimeError(
                    "an in-place write to a tensor made in inference mode, outside it: "
                    "write to a clone of it instead (tensor.clone())"
                )
            torch.autograd.graph.increment_version(written)
            return written

        ledgers = _ledgers_here()
        if (
            not ledgers
            or (wrapped and op in _COPIES)  # a Python number written: no host memory crosses
            or (stays is not None and stays(args, kwargs, ledgers))
            or not _counting_now()
            or (_state.inference_counter is not None and torch.is_inference_mode_enabled())
            or (keyset.has(_PYTHON) and _traced(args))
        ):
            return run()
        return _counted_operation(op, run, args, kwargs, ledgers)

    return kernel


# The watched operations that are most often nothing to count (an optimizer reading its
# host step counters, autocast's casts, a copy within one device), told apart early.
_STAYS: dict[Any, Callable[[tuple, dict, list[OpenLedger]], bool]] = {
    _ITEM: lambda args, kwargs, ledgers: (
        args[0].device.type == "cpu" and not _any_for_the_host(ledgers)
    ),
    _TO_COPY: lambda args, kwargs, ledgers: kwargs.get("device") in (None, args[0].device),
    _COPY: lambda args, kwargs, ledgers: args[0].device == args[1].device,
}


def _counted_operation(
    op: Any,
    run: Callable[[], Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ledgers: list[OpenLedger],
) -> Any:
    """``run()`` ``op``, counting it in ``ledgers``."""
    before, after = _COUNTERS[op]
    if before is not None:
        before(args, kwargs, ledgers)
    nested, _state.inside_op = _state.inside_op, True
    try:
        out = run()
    finally:
        _state.inside_op = nested
    if after is not None:
        after(args, kwargs, out, ledgers)
    return out


# What each watched operation counts: a wait before it runs (so that an at-site budget stops
# it there), a copy after it.


def _before_item(args: tuple, kwargs: dict, ledgers: list[OpenLedger]) -> None:
    if _is_device(args[0]):
        _copy(ledgers, "d2h", args[0], args[0].element_size(), "item", True, False)
    else:
        _record_host_read("item", ledgers)


def _waits_for(label: str) -> Callable[[tuple, dict, list[OpenLedger]], None]:
    def before(args: tuple, kwargs: dict, ledgers: list[OpenLedger]) -> None:
        if any(_is_device(a) for a in args):
            _record_sync(label, ledgers)
        else:
            _record_host_read(label, ledgers)

    return before


_repeat_interleave_waits = _waits_for(_DATA_DEPENDENT[_REPEAT_INTERLEAVE])


def _before_repeat_interleave(args: tuple, kwargs: dict, ledgers: list[OpenLedger]) -> None:
    if kwargs.get("output_size") is None:  # given the output's size, it need not wait
        _repeat_interleave_waits(args, kwargs, ledgers)


def _before_indexing(args: tuple, kwargs: dict, ledgers: list[OpenLedger]) -> None:
    if _has_mask(args[1]):
        if _is_device(args[0]):
            _record_sync("boolean-mask indexing", ledgers)
        else:
            _record_host_read("boolean-mask indexing", ledgers)


def _after_to_copy(args: tuple, kwargs: dict, out: Any, ledgers: list[OpenLedger]) -> None:
    _transfer(ledgers, args[0], out, kwargs.get("non_blocking", False), "to")


def _after_copy(args: tuple, kwargs: dict, out: Any, ledgers: list[OpenLedger]) -> None:
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    _transfer(ledgers, args[1], args[0], non_blocking, "copy_")


def _after_lift_fresh(args: tuple, kwargs: dict, out: Any, ledgers: list[OpenLedger]) -> None:
    if _is_device(out):  # made from host data, copied blocking
        _copy(ledgers, "h2d", out, out.numel() * out.element_size(), "torch.tensor", True, False)


_COUNTERS: dict[Any, tuple[Callable[..., None] | None, Callable[..., None] | None]] = {
    _ITEM: (_before_item, None),
    _TO_COPY: (None, _after_to_copy),
    _COPY: (None, _after_copy),
    _LIFT_FRESH: (None, _after_lift_fresh),
    **{op: (_waits_for(label), None) for op, label in _DATA_DEPENDENT.items()},
    _REPEAT_INTERLEAVE: (_before_repeat_interleave, None),
    **{op: (_before_indexing, None) for op in _MASK_INDEXING},
}


def _transfer(ledgers: list[OpenLedger], src: Any, dst: Any, non_blocking: bool, op: str) -> None:
    """Count ``src`` -> ``dst`` if it crosses between host and device or between two
    devices (a dtype conversion on one device is compute, not a transfer)."""
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        return
    if src.device == dst.device:  # a cast or a copy in place: compute, not a transfer
        return
    s, d = _is_device(src), _is_device(dst)
    if (not s and not d) or (s and d and src.device == dst.device):
        return
    kind = "d2d" if s and d else "h2d" if d else "d2h"
    pinned = None if kind == "d2d" else _host_pinned(src if kind == "h2d" else dst)
    # Without non_blocking, torch waits for a copy to or from the host to finish.
    blocking = kind != "d2d" and not non_blocking
    _copy(ledgers, kind, dst, dst.numel() * dst.element_size(), op, blocking, pinned)


def _copy(
    ledgers: list[OpenLedger],
    kind: str,
    t: torch.Tensor,
    nbytes: int,
    op: str,
    blocking: bool,
    pinned: bool | None = None,
) -> None:
    where = caller_location()
    dtype = str(t.dtype).removeprefix("torch.")
    _emit(
        lambda ledger: TransferEvent(
            kind, op, where, ledger._step, nbytes, dtype, pinned, blocking
        ),
        ledgers,
    )
    if blocking:
        label = f"blocking {kind} {op}"
        _emit(lambda ledger: TransferEvent("sync", label, where, ledger._step), ledgers)


def _has_mask(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )
