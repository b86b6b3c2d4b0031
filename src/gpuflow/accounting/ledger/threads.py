"""Which ledgers count this thread's work: those it opened and, on autograd's device threads,
those of the thread whose backward they run; and whether what runs now is counted at all."""

from __future__ import annotations

import ctypes
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpuflow.accounting.ledger.records import OpenLedger


class _State(threading.local):
    """What one thread keeps while it counts."""

    def __init__(self) -> None:
        self.ledgers: list[OpenLedger] = []
        self.inside_op = False  # a counted operation runs: what it calls is part of it
        self.inference_counter: TorchDispatchMode | None = None  # counts in inference mode
        self.carried: list[OpenLedger] | None = None  # inside a _Carrier's call
        self.stashed = False  # this thread's list is in torch's thread-local objects
        self.recording = False  # this thread listens for copies the transfer layer reports
        self.inside_wait = False  # a counted wait or read is running: what it calls is its own


_state = _State()


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


def _stash(ledgers: list[OpenLedger]) -> None:
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

    def __init__(self, ledgers: list[OpenLedger]) -> None:
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


def _carried_in() -> list[OpenLedger] | None:
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


def _ledgers_here() -> list[OpenLedger]:
    """The ledgers counting this thread's work: those it opened and, on autograd's device
    threads, those of the thread whose backward they run."""
    own = _state.ledgers
    carried = _carried_in()
    if carried is None or carried is own:
        return own
    return [*carried, *own] if own else carried


def _counting_now() -> bool:
    """Not while a counted operation, a tensor's repr or torch.compile runs: what they call
    is theirs (a compiler's tracing and autotuning; the compiled code is counted when it runs)."""
    return not (_state.inside_op or torch.compiler.is_compiling())
