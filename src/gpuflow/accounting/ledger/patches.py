"""What an open ledger puts into torch, and takes out again when the last one closes: the
counting kernels' registration, and wrappers of the functions that wait for the device or
read tensor data, run a backward, or enter and leave inference mode."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from gpuflow.accounting.ledger.dispatch import (
    _KEY,
    _KEY_OF,
    _WATCHED,
    _counting_kernel,
    _InferenceCounter,
    _is_device,
    _record_host_read,
    _record_sync,
)
from gpuflow.accounting.ledger.threads import _Carrier, _counting_now, _ledgers_here, _state
from gpuflow.device.accelerator import Device, HostEvent, HostStream

_patch_lock = threading.Lock()
_ABSENT = object()  # an attribute the owner only inherits: deleted again, not set back
_patched: dict[tuple[Any, str], Any] = {}
_patch_users = 0
_kernels: torch.library.Library | None = None
_kernel_of: dict[Any, Callable[..., Any]] = {}  # made once, registered while a ledger is open


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


def _stop_inference_counter(owner: Any, *, is_ledger: bool = False) -> None:
    """``owner`` ends: its counter stops, or, if ``owner`` is a ledger (``is_ledger``) that
    others outlive in inference mode (ledgers may close in any order), passes to the newest
    of them."""
    counter = vars(owner).pop("_gpuflow_inference_counter", None)
    if counter is None:
        return
    if is_ledger and _state.ledgers and torch.is_inference_mode_enabled():
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
