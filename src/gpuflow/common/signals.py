"""Signal handlers for the length of a block."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def handling(
    signals: Iterable[signal.Signals], handler: Callable[[int, object], None]
) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, then the handlers there were before
    (where the block set another meanwhile, that one stays). Off the main thread, where
    Python allows no handler, nothing changes."""
    try:
        previous = {sig: signal.signal(sig, handler) for sig in signals}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, old)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
_MASKS = hasattr(signal, "pthread_sigmask")  # (not on Windows)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the block to end, then act as they would have: for a
    step that must not be cut in two, such as starting a child and keeping its handle (an
    interrupt in between leaves a child that nothing will stop). Off the main thread,
    nothing changes."""
    arrived: list[int] = []
    try:
        with handling(INTERRUPTS, lambda signum, _: arrived.append(signum)):
            yield
    finally:
        if arrived:
            signal.raise_signal(arrived[0])  # to the handler there was before


@contextmanager
def interrupts_held() -> Iterator[None]:
    """``interrupts_deferred`` for the start of a multiprocessing child, which an interrupt
    part way through leaves unable to boot (its arguments half sent, or the pool never told
    of it), so that it prints a traceback.

    Children started inside begin with both signals blocked: a Ctrl-C at a terminal, which
    reaches the whole process group, would otherwise stop each child in its imports, with a
    traceback. ``take_interrupts_in_child`` at the child's entry point settles them."""
    with interrupts_deferred():
        if not _MASKS or threading.current_thread() is not threading.main_thread():
            yield
            return
        # multiprocessing starts its resource tracker with the first child, and unblocks both
        # signals once it has: started first, it leaves the mask alone.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (what was pending runs now)


def take_interrupts_in_child() -> None:
    """In a child started under ``interrupts_held``: ignore Ctrl-C (the parent stops it, and
    says why) and take SIGTERM again, a pending one included."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _MASKS:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
