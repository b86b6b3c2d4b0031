"""Where transfer-layer code reports copies that the ledger cannot see for itself.

The ledger sees the operations of its own thread only, when they are made.
``DeviceLoader`` queues a batch's copy before the consumer takes it (and shares one copy
among small batches), so it makes its copies as housekeeping and reports each batch here
when the consumer takes it; the ledgers open on the consumer's thread count it then. The
transfer and data layers report here without importing the ledger, which listens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# (kind, nbytes, op, dtype, pinned) -> None
CopyListener = Callable[[str, int, str, str | None, bool | None], None]


class _Listeners(threading.local):
    def __init__(self) -> None:
        self.items: list[CopyListener] = []


_listeners = _Listeners()


def listen(listener: CopyListener) -> None:
    _listeners.items.append(listener)


def stop_listening(listener: CopyListener) -> None:
    _listeners.items.remove(listener)


def report_copy(
    kind: str, nbytes: int, op: str, dtype: str | None = None, pinned: bool | None = None
) -> None:
    """Count a copy made on this thread's behalf in every ledger open on this thread."""
    for listener in _listeners.items:
        listener(kind, nbytes, op, dtype, pinned)


class _Housekeeping(threading.local):
    """Waits and copies the transfer layer makes for itself (a closing loader finishing its
    copies, freeing its memory): the ledgers open on this thread leave them out, so that they
    do not count against the region of the code that closed it. A plain context manager (not
    a generator one): the loader enters it once per copy it queues."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


_housekeeping = _Housekeeping()


def housekeeping() -> _Housekeeping:
    """``with housekeeping():`` marks the transfer layer's own work; see ``_Housekeeping``."""
    return _housekeeping


def in_housekeeping() -> bool:
    return _housekeeping.depth > 0
