"""Host->device copies queued by one call into the CUDA driver (``cuMemcpyHtoDAsync``).

``dst.copy_(src, non_blocking=True)`` spends several times the host time of the driver call
behind it (dispatch, views, the pinned allocator's bookkeeping), more than the copy of a
small batch takes on the bus. A loader that queues a copy per batch spends that difference
on every batch, so ``DeviceLoader`` calls the driver itself for its copies
(docs/decisions/017 has the figures).

What torch's copy would have done and the caller must do instead: keep the host memory
alive and unchanged until the copy has run (torch records an event for pinned memory from
its own allocator; ``DeviceLoader`` keeps the source tensors until its event completes);
copy only from pinned memory (from pageable memory the driver copies synchronously); and,
when the driver refuses (a thread with no CUDA context current, a stream of another
device), copy through torch instead.

The call keeps the interpreter lock (``ctypes.PyDLL``): from pinned memory it only queues
the copy, and letting go of the lock for those microseconds let another Python thread
(DataLoader's pin-memory thread, in a worker-fed loop) take it, so the training thread then
waited to get it back, and its copies took about twice as long (docs/decisions/042). From
pageable memory the call
would copy synchronously with every Python thread stopped: one more reason it is only
given pinned memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

# (device address, host address, bytes, stream handle) -> CUresult, 0 when queued
DriverCopy = Callable[[int, int, int, int], int]


@functools.cache
def driver_copy() -> DriverCopy | None:
    """The driver's asynchronous host->device copy, or None where there is no CUDA driver."""
    try:
        driver = ctypes.PyDLL("libcuda.so.1")  # the lock kept: see above
        call = driver.cuMemcpyHtoDAsync_v2
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    call.restype = ctypes.c_int
    return call
