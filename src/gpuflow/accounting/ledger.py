"""Every bus crossing, host sync and device allocation in a region, counted with its source.

    with gpuflow.TransferLedger() as ledger:
        for step in range(20):
            train_step()
            ledger.step()                 # closes one step
    print(ledger.summary().table())      # totals, per-step medians, top locations

What it counts and how, what it cannot see, and what it costs: docs/architecture/ledger.md.
Longer than most modules: the counting kernels, the inference-mode counter, the wait
wrappers and the ledgers share one thread-local state.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpuflow.common.layers import LOOKED_THROUGH
from gpuflow.device.accelerator import Device, HostEvent, HostStream
from gpuflow.transfer import tally

# disk2d: file bytes read straight into device memory (kvikio), reported by the reader.
COPY_KINDS = ("h2d", "d2h", "d2d", "disk2d")

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

_TORCH_DIR = str(Path(torch.__file__).parent)
# The layers that carry a crossing out (gpuflow.common.layers): their frames are skipped when
# locating an event, so that training code, the CLI and user code count as the caller.
_INTERNAL = tuple(str(Path(__file__).parents[1] / layer) + os.sep for layer in LOOKED_THROUGH)
_SKIPPED = (_TORCH_DIR, f"{os.sep}contextlib.py", "<frozen ")


@dataclass(frozen=True)
class TransferEvent:
    """One counted operation: a copy (``kind`` h2d/d2h/d2d/disk2d) or a host ``sync``."""

    kind: str
    op: str
    location: str  # "file:line" of the caller
    step: int
    nbytes: int = 0
    dtype: str | None = None
    pinned: bool | None = None  # host memory of a copy: page-locked?
    blocking: bool = False  # did the host wait for it?

    def describe(self) -> str:
        if self.kind == "sync":
            return f"sync  {self.op}  at {self.location}"
        memory = {True: "pinned", False: "pageable", None: "device"}[self.pinned]
        if self.kind == "disk2d":
            memory = "file"
        mode = "blocking" if self.blocking else "async"
        return (
            f"{self.kind}  {self.nbytes:,} B {self.dtype} {memory} {mode} ({self.op})  "
            f"at {self.location}"
        )


@dataclass(frozen=True)
class StepTotals:
    """What one step (or a whole region) did."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    disk2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    d2d_copies: int = 0
    disk2d_copies: int = 0
    syncs: int = 0
    device_allocs: int = 0  # cudaMalloc calls
    device_frees: int = 0  # cudaFree calls
    alloc_retries: int = 0  # allocations that had to free cached blocks and retry
    allocator_requests: int = 0  # tensors served by the caching allocator
    reserved_bytes: int = 0  # device memory the allocator holds at the step's end

    @classmethod
    def of(cls, events: list[TransferEvent], allocator: dict[str, int]) -> StepTotals:
        counts: dict[str, int] = dict.fromkeys(f.name for f in fields(cls)) | dict(allocator)
        for name in counts:
            counts[name] = counts[name] or 0
        for e in events:
            if e.kind == "sync":
                counts["syncs"] += 1
            else:
                counts[f"{e.kind}_bytes"] += e.nbytes
                counts[f"{e.kind}_copies"] += 1
        return cls(**counts)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def per_step(self, steps: int = 1) -> dict[str, float]:
        """What each of ``steps`` steps moved, waited for and allocated: the bus fields of
        metrics.jsonl and of ``gpuflow bench train``."""
        return {
            "h2d_bytes_per_step": self.h2d_bytes / steps,
            "d2h_bytes_per_step": self.d2h_bytes / steps,
            "disk2d_bytes_per_step": self.disk2d_bytes / steps,
            "syncs_per_step": self.syncs / steps,
            "device_allocs_per_step": self.device_allocs / steps,
        }


@dataclass(frozen=True)
class LedgerSummary:
    totals: StepTotals
    steps: list[StepTotals]
    top_by_bytes: list[tuple[str, int]]  # (location, bytes copied)
    top_by_syncs: list[tuple[str, int]]  # (location, syncs)

    def median(self, name: str) -> float:
        values = [getattr(s, name) for s in self.steps]
        return statistics.median(values) if values else 0.0

    def table(self) -> str:
        """A plain-text report: totals, per-step medians and the busiest locations."""
        names = [f.name for f in fields(StepTotals)]
        width = max(map(len, names))
        lines = [f"{'':{width}}  {'total':>14}  {'per-step median':>16}"]
        for name in names:
            lines.append(
                f"{name:{width}}  {getattr(self.totals, name):>14,}  {self.median(name):>16,.1f}"
            )
        lines.append(f"steps: {len(self.steps)}")
        for title, rows, unit in (
            ("top locations by bytes", self.top_by_bytes, "B"),
            ("top locations by syncs", self.top_by_syncs, "syncs"),
        ):
            if rows:
                lines.append(title + ":")
                lines += [f"  {count:>14,} {unit}  {where}" for where, count in rows]
        return "\n".join(lines)


class _Allocator:
    """Cumulative device allocator counters, read at step boundaries (cuda only)."""

    KEYS: ClassVar[dict[str, str]] = {
        "device_allocs": "segment.all.allocated",
        "device_frees": "segment.all.freed",
        "alloc_retries": "num_alloc_retries",
        "allocator_requests": "allocation.all.allocated",
    }

    def __init__(self, device: Device) -> None:
        self.device = device
        self.active = device.type == "cuda" and torch.cuda.is_available()
        self.last = self.read()

    def read(self) -> dict[str, int]:
        if not self.active:
            return {}
        stats = torch.cuda.memory_stats(self.device.torch)
        return {name: int(stats.get(key, 0)) for name, key in self.KEYS.items()} | {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0))
        }

    def delta(self) -> dict[str, int]:
        """The counters since the last delta (reserved bytes: as they are now)."""
        now = self.read()
        out = self.between(self.last, now)
        self.last = now
        return out

    @staticmethod
    def between(start: dict[str, int], end: dict[str, int]) -> dict[str, int]:
        out = {k: v - start.get(k, 0) for k, v in end.items() if k != "reserved_bytes"}
        if end:
            out["reserved_bytes"] = end["reserved_bytes"]
        return out


def _shorter(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative


def caller_location() -> str:
    """``file:line`` of the innermost frame outside torch and gpuflow's transfer layer."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_INTERNAL) and not any(s in name for s in _SKIPPED):
            return f"{_shorter(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


# ---- the recorder: kernels and wrappers shared by nested ledgers and threads ---------------


class _State(threading.local):
    def __init__(self) -> None:
        self.ledgers: list[TransferLedger] = []
        self.inside_op = False  # a counted operation runs: what it calls is part of it
        self.inference_counter: _InferenceCounter | None = None
        self.carried: list[TransferLedger] | None = None  # inside a _Carrier's call
        self.stashed = False  # this thread's list is in torch's thread-local objects
        self.recording = False  # this thread listens for copies the transfer layer reports
        self.inside_wait = False  # a counted wait or read is running: what it calls is its own


_state = _State()
_patch_lock = threading.Lock()
_ABSENT = object()  # an attribute the owner only inherits: deleted again, not set back
_patched: dict[tuple[Any, str], Any] = {}
_patch_users = 0
_kernels: torch.library.Library | None = None
_kernel_of: dict[Any, Callable[..., Any]] = {}  # made once, registered while a ledger is open

# Frames that only carry a read to its cause (the dispatch machinery, torch.compile's
# wrappers, Tensor's Python methods, this module); and
# frames whose reads are of host data on a GPU machine too: an optimizer's step counters, a
# DataLoader's batches, compilation, gpuflow's transfer layer and its host buffers. A host
# read made straight from a frame of the second kind is not one that would wait for a GPU.
_DISPATCH_FILES = (
    "utils/_python_dispatch.py", "_ops.py", "_tensor.py", "overrides.py", "_compile.py",
    "_dynamo/eval_frame.py",
)  # fmt: skip
_HOST_SIDE_DIRS = ("optim", "utils/data", "_dynamo", "_inductor", "fx", "_functorch", "_subclasses")
_PLUMBING = (
    *(str(Path(_TORCH_DIR, *part.split("/"))) for part in _DISPATCH_FILES),
    str(Path(__file__).parent) + os.sep,
    f"{os.sep}contextlib.py",
    "<frozen ",
)
_HOST_SIDE = (
    *_INTERNAL,
    *(str(Path(_TORCH_DIR, *part.split("/"))) + os.sep for part in _HOST_SIDE_DIRS),
)


# How autograd's device threads, which run a CUDA backward and its gradient hooks, find the
# ledgers of the thread whose backward it is. They take over that thread's thread-local
# Python objects, where the thread keeps its ledger list from its first ledger to its last.
# Torch frees what is left there as a thread ends, which aborts a process that is exiting
# meanwhile: a torch that cannot take an object out again (2.11) keeps the list there for
# the main thread only (its objects are freed after the interpreter), and other threads
# carry theirs in a function mode pushed for each backward, which every Python-level torch
# call during it pays for.
_CARRIED = "gpuflow.accounting.ledgers"
_CAN_REMOVE = hasattr(torch._C, "_remove_obj_from_tls")
_PROBE = _CARRIED + ".probe"
_stash_steals: bool | None = None


def _stash(ledgers: list[TransferLedger]) -> None:
    """Some torch versions (2.11) keep a stashed object without a reference of their own
    and drop one when it goes: the reference is given to them here."""
    global _stash_steals
    if _stash_steals is None:
        probe = object()
        before = sys.getrefcount(probe)
        torch._C._stash_obj_in_tls(_PROBE, probe)
        _stash_steals = sys.getrefcount(probe) == before
        if _stash_steals:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))
        if _CAN_REMOVE:
            torch._C._remove_obj_from_tls(_PROBE)
    if _stash_steals:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(ledgers))
    torch._C._stash_obj_in_tls(_CARRIED, ledgers)


def _carry() -> None:
    """At a thread's first ledger: its list where autograd's threads will find it. A thread
    that runs another's backward keeps the list carried in."""
    if _state.stashed or torch._C._is_key_in_tls(_CARRIED):
        return
    if _CAN_REMOVE or threading.current_thread() is threading.main_thread():
        _stash(_state.ledgers)
        _state.stashed = True


def _uncarry() -> None:
    """At a thread's last ledger: nothing of it left for torch to free as the thread ends."""
    if _state.stashed and _CAN_REMOVE:
        torch._C._remove_obj_from_tls(_CARRIED)
        _state.stashed = False


class _Carrier(TorchFunctionMode):
    """Carries the ledgers of a thread that could not stash them into the backward it runs
    (see ``_CARRIED``). On the stack only for that backward; it passes every call through."""

    def __init__(self, ledgers: list[TransferLedger]) -> None:
        super().__init__()
        self.ledgers = ledgers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch sets the mode aside while the call runs: its operations find the ledgers
        # here instead.
        carried, _state.carried = _state.carried, self.ledgers
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _state.carried = carried


def _carried_in() -> list[TransferLedger] | None:
    """The ledgers of another thread whose backward this thread runs, if any."""
    if _state.carried is not None:
        return _state.carried
    if not _state.stashed and torch._C._is_key_in_tls(_CARRIED):
        return torch._C._get_obj_in_tls(_CARRIED)
    for i in range(torch._C._len_torch_function_stack()):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, _Carrier):
            return mode.ledgers
    return None


def _ledgers_here() -> list[TransferLedger]:
    """The ledgers counting this thread's work: those it opened and, on autograd's device
    threads, those of the thread whose backward they run."""
    own = _state.ledgers
    carried = _carried_in()
    if carried is None or carried is own:
        return own
    return [*carried, *own] if own else carried


# Frames of torch.compile at work (tracing, code generation, autotuning): what runs under them
# is the compiler's, not the region's. The code it makes runs without them, and is counted.
_COMPILER_FILES = frozenset(
    str(Path(_TORCH_DIR, *part.split("/")))
    for part in ("_dynamo/convert_frame.py", "_inductor/compile_fx.py")
)


# torch.compile converts every Python frame that starts while a compiled function runs, unless
# its file is on dynamo's skip list: the counting kernels that an operation run eagerly there
# calls (the `.item()` at a graph break), and the wrappers of the reads and waits, would be
# traced, read torch.compiler.is_compiling() as True, and count nothing. The ledger's files
# go on that list once dynamo has loaded it, which is before anything can be compiled; it is
# looked up, never imported here (a kernel may run while dynamo is being imported).
_OUT_OF_DYNAMO = ("gpuflow.accounting", "gpuflow.transfer.tally")
_dynamo_told = False


def _keep_out_of_dynamo() -> None:
    global _dynamo_told
    add = getattr(sys.modules.get("torch._dynamo.trace_rules"), "add", None)
    if _dynamo_told or add is None:
        return
    for module in _OUT_OF_DYNAMO:
        add(module)
    _dynamo_told = True


def _inside_the_compiler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _COMPILER_FILES:
            return True
        frame = frame.f_back
    return False


def _emit(
    make: Callable[[TransferLedger], TransferEvent],
    ledgers: list[TransferLedger],
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
    """A copy another thread made for this one (``gpuflow.transfer.tally``)."""
    where = caller_location()
    _emit(
        lambda ledger: TransferEvent(
            kind, op, where, ledger._step, nbytes=nbytes, dtype=dtype, pinned=pinned
        ),
        _state.ledgers,
    )


def _record_sync(op: str, ledgers: list[TransferLedger]) -> None:
    where = caller_location()
    _emit(lambda ledger: TransferEvent("sync", op, where, ledger._step), ledgers)


def _reads_device_data() -> bool:
    """Whether a read of host tensor data, made now, stands for a read of device data: the
    code that makes it is not one that reads host data on a GPU machine too."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    return frame is None or not frame.f_code.co_filename.startswith(_HOST_SIDE)


def _any_for_the_host(ledgers: list[TransferLedger]) -> bool:
    return any(ledger.host_reads for ledger in ledgers)


def _record_host_read(op: str, ledgers: list[TransferLedger]) -> None:
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

    def __init__(self, ledgers: list[TransferLedger]) -> None:
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


def _counting_now() -> bool:
    """Not while a counted operation, a tensor's repr or torch.compile runs: what they call
    is theirs (a compiler's tracing and autotuning; the compiled code is counted when it runs)."""
    return not (_state.inside_op or torch.compiler.is_compiling())


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
_STAYS: dict[Any, Callable[[tuple, dict, list[TransferLedger]], bool]] = {
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
    ledgers: list[TransferLedger],
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


def _before_item(args: tuple, kwargs: dict, ledgers: list[TransferLedger]) -> None:
    if _is_device(args[0]):
        _copy(ledgers, "d2h", args[0], args[0].element_size(), "item", True, False)
    else:
        _record_host_read("item", ledgers)


def _waits_for(label: str) -> Callable[[tuple, dict, list[TransferLedger]], None]:
    def before(args: tuple, kwargs: dict, ledgers: list[TransferLedger]) -> None:
        if any(_is_device(a) for a in args):
            _record_sync(label, ledgers)
        else:
            _record_host_read(label, ledgers)

    return before


_repeat_interleave_waits = _waits_for(_DATA_DEPENDENT[_REPEAT_INTERLEAVE])


def _before_repeat_interleave(args: tuple, kwargs: dict, ledgers: list[TransferLedger]) -> None:
    if kwargs.get("output_size") is None:  # given the output's size, it need not wait
        _repeat_interleave_waits(args, kwargs, ledgers)


def _before_indexing(args: tuple, kwargs: dict, ledgers: list[TransferLedger]) -> None:
    if _has_mask(args[1]):
        if _is_device(args[0]):
            _record_sync("boolean-mask indexing", ledgers)
        else:
            _record_host_read("boolean-mask indexing", ledgers)


def _after_to_copy(args: tuple, kwargs: dict, out: Any, ledgers: list[TransferLedger]) -> None:
    _transfer(ledgers, args[0], out, kwargs.get("non_blocking", False), "to")


def _after_copy(args: tuple, kwargs: dict, out: Any, ledgers: list[TransferLedger]) -> None:
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    _transfer(ledgers, args[1], args[0], non_blocking, "copy_")


def _after_lift_fresh(args: tuple, kwargs: dict, out: Any, ledgers: list[TransferLedger]) -> None:
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


def _transfer(
    ledgers: list[TransferLedger], src: Any, dst: Any, non_blocking: bool, op: str
) -> None:
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
    ledgers: list[TransferLedger],
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


def _wait_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of every explicit host wait the ledger wraps."""
    targets = [
        (Device, "synchronize", "Device.synchronize"),
        (HostEvent, "synchronize", "Event.synchronize"),
        (HostStream, "synchronize", "Stream.synchronize"),
    ]
    if torch.cuda.is_available():
        targets += [
            (torch.cuda, "synchronize", "torch.cuda.synchronize"),
            (torch.cuda.Event, "synchronize", "Event.synchronize"),
            (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
        ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return targets


def _counted_wait(original: Callable[..., Any], label: str) -> Callable[..., Any]:
    def wait(*args: Any, **kwargs: Any) -> Any:
        ledgers = _ledgers_here()
        if ledgers and not _state.inside_wait and _counting_now():
            _record_sync(label, ledgers)
            _state.inside_wait = True  # one wait that calls another counts once
            try:
                return original(*args, **kwargs)
            finally:
                _state.inside_wait = False
        return original(*args, **kwargs)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def _counted_read(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    """Reads of tensor data that no counted operation shows: ``tolist`` of a host tensor
    (a device tensor's is counted as its copy to the host), and a tensor's repr (``print``,
    f-strings), whose own operations are the print's and are not counted again."""

    def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ledgers = _ledgers_here()
        busy = _state.inside_wait or not _counting_now()
        if ledgers and not busy and isinstance(tensor, torch.Tensor):
            if not _is_device(tensor):
                _record_host_read(op, ledgers)
            elif op == "print":
                _record_sync("print of a device tensor", ledgers)
            # What the read calls is part of it: a repr's operations are the print's (as a
            # counted operation's are its own), while a device tensor's tolist is counted as
            # its copy to the host.
            flag = "inside_op" if op == "print" else "inside_wait"
            setattr(_state, flag, True)
            try:
                return original(tensor, *args, **kwargs)
            finally:
                setattr(_state, flag, False)
        return original(tensor, *args, **kwargs)

    read.__wrapped__ = original  # type: ignore[attr-defined]
    return read


def _start_inference_counter(owner: Any) -> None:
    """Counts for this thread's ledgers while it is in inference mode; ``owner`` (a ledger or
    an inference_mode context) stops it when it ends."""
    if _state.ledgers and _state.inference_counter is None and torch.is_inference_mode_enabled():
        counter = _InferenceCounter(_state.ledgers)
        counter.__enter__()
        _state.inference_counter = counter
        owner._gpuflow_inference_counter = counter


def _stop_inference_counter(owner: Any) -> None:
    """``owner`` ends: its counter stops, or, if ``owner`` is a ledger that others outlive
    in inference mode (ledgers may close in any order), passes to the newest of them."""
    counter = vars(owner).pop("_gpuflow_inference_counter", None)
    if counter is None:
        return
    if isinstance(owner, TransferLedger) and _state.ledgers and torch.is_inference_mode_enabled():
        _state.ledgers[-1]._gpuflow_inference_counter = counter
        return
    _state.inference_counter = None
    counter.__exit__(None, None, None)


def _counted_inference_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    def enter(self: Any) -> Any:
        out = original(self)
        _start_inference_counter(self)
        return out

    enter.__wrapped__ = original  # type: ignore[attr-defined]
    return enter


def _counted_inference_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def exit_(self: Any, *exc: Any) -> Any:
        _stop_inference_counter(self)
        return original(self, *exc)

    exit_.__wrapped__ = original  # type: ignore[attr-defined]
    return exit_


def _carried_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """A backward run for ledgers carries them to autograd's threads."""

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        ledgers = _ledgers_here()
        if not ledgers or _state.stashed:  # a stashed list reaches autograd's threads itself
            return original(*args, **kwargs)
        with _Carrier(ledgers):
            return original(*args, **kwargs)

    run_backward.__wrapped__ = original  # type: ignore[attr-defined]
    return run_backward


def _patch_targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(owner, attribute, wrapper maker) of every function a ledger wraps while open. Only
    functions that torch.compile does not guard on: wrapping ``torch.tensor`` itself, say,
    would make every compiled function that calls it recompile as a ledger opens."""
    waits = [
        (owner, attr, lambda f, label=label: _counted_wait(f, label))
        for owner, attr, label in _wait_targets()
    ]
    return [
        *waits,
        (torch.Tensor, "tolist", lambda f: _counted_read(f, "tolist")),
        (torch._tensor_str, "_str", lambda f: _counted_read(f, "print")),
        # Both names torch.autograd.backward and grad may call it by.
        (torch.autograd.graph, "_engine_run_backward", _carried_backward),
        (torch.autograd, "_engine_run_backward", _carried_backward),
        (torch.autograd.grad_mode.inference_mode, "__enter__", _counted_inference_enter),
        (torch.autograd.grad_mode.inference_mode, "__exit__", _counted_inference_exit),
    ]


def _install_waits() -> None:
    """The first ledger of the process wraps the waits and registers the kernels; a failure
    part-way takes back what was done."""
    global _patch_users, _kernels
    with _patch_lock:
        if _patch_users == 0:
            try:
                for owner, attr, wrap in _patch_targets():
                    _patched[(owner, attr)] = vars(owner).get(attr, _ABSENT)
                    setattr(owner, attr, wrap(getattr(owner, attr)))
                if not _kernel_of:
                    _kernel_of.update({op: _counting_kernel(op) for op in _WATCHED})
                _kernels = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():  # copy_ and index_put_ have one there: replaced
                    warnings.simplefilter("ignore", UserWarning)
                    for op in _WATCHED:
                        key = _KEY_OF.get(op, _KEY).name
                        _kernels.impl(op, _kernel_of[op], key, with_keyset=True)
            except BaseException:
                _restore_all()
                raise
        _patch_users += 1


def _remove_waits() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            _restore_all()


def _restore_all() -> None:
    global _kernels
    try:
        for (owner, attr), original in _patched.items():
            if original is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
    finally:
        _patched.clear()
        if _kernels is not None:
            kernels, _kernels = _kernels, None
            kernels._destroy()


# ---- the public ledger ------------------------------------------------------------------------


@dataclass(eq=False)  # a ledger is a region: two are never the same because they counted alike
class TransferLedger:
    """See the module docstring. Ledgers nest, in any order of exit: an operation counts in
    every open ledger of its thread. ``device`` is whose allocator statistics are read."""

    device: Device | str = "auto"
    # Whether reads of host tensors count as the syncs they would be on a GPU: for the cpu
    # only; a ledger for an accelerator counts what waits on it.
    host_reads: bool = field(default=False, init=False)
    _events: list[TransferEvent] = field(default_factory=list, init=False, repr=False)
    _steps: list[StepTotals] = field(default_factory=list, init=False, repr=False)
    _step: int = field(default=0, init=False, repr=False)
    _step_start: int = field(default=0, init=False, repr=False)
    _open: bool = field(default=False, init=False, repr=False)
    # Sees each event as it is counted; an exception it returns is raised at the operation
    # (a budget with at_site=True).
    _watch: Callable[[TransferEvent], Exception | None] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.device = Device.resolve(self.device)
        self.host_reads = self.device.type == "cpu"

    def __enter__(self) -> TransferLedger:
        if self._open:
            raise RuntimeError("this TransferLedger is already open")
        _keep_out_of_dynamo()
        self._allocator = _Allocator(self.device)
        self._region_start = dict(self._allocator.last)
        _install_waits()
        try:
            if not _state.recording:
                tally.listen(_record_reported)
                _state.recording = True
                _carry()
            _state.ledgers.append(self)
            _start_inference_counter(self)  # opened inside inference mode
        except BaseException:
            self._leave()
            raise
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()
        self._region_end = self._allocator.read()
        if self._step_start < len(self._events) or not self._steps:
            self.step()  # the events since the last step() form a last step
        self._open = False

    def _leave(self) -> None:
        """Whatever happens, the thread's last ledger out takes the recorder with it."""
        try:
            _state.ledgers[:] = [ledger for ledger in _state.ledgers if ledger is not self]
            _stop_inference_counter(self)
        finally:
            try:
                if _state.recording and not _state.ledgers:
                    _state.recording = False
                    try:
                        tally.stop_listening(_record_reported)
                    finally:
                        _uncarry()
            finally:
                _remove_waits()

    def step(self) -> StepTotals:
        """Close the current step; returns its totals."""
        events = self._events[self._step_start :]
        totals = StepTotals.of(events, self._allocator.delta() if self._open else {})
        self._steps.append(totals)
        self._step += 1
        self._step_start = len(self._events)
        return totals

    @property
    def events(self) -> list[TransferEvent]:
        return list(self._events)

    def summary(self, top: int = 5) -> LedgerSummary:
        end = getattr(self, "_region_end", None) or self._allocator.read()
        allocator = _Allocator.between(self._region_start, end)
        by_bytes: Counter[str] = Counter()
        by_syncs: Counter[str] = Counter()
        for e in self._events:
            if e.kind == "sync":
                by_syncs[e.location] += 1
            else:
                by_bytes[e.location] += e.nbytes
        return LedgerSummary(
            StepTotals.of(self._events, allocator),
            list(self._steps),
            by_bytes.most_common(top),
            by_syncs.most_common(top),
        )
