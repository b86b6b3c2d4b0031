"""Signal handlers for the length of a block."""

from __future__ import annotations

import signal
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
