"""The operating system's page cache for one file: how much of it is cached, and dropping it.

A read benchmark is only "cold" if the file's pages are not in memory. Dropping the whole
cache (``/proc/sys/vm/drop_caches``) needs root; ``posix_fadvise(DONTNEED)`` asks the kernel
to drop one file's clean pages and needs nothing, and ``mincore`` says whether it did.
Linux only: elsewhere both report that they cannot (None, False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

_PAGE = mmap.PAGESIZE


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def cached_fraction(path: Path | str) -> float | None:
    """The share of ``path``'s pages in the page cache, in [0, 1]; None where it cannot be
    asked. Maps the file without reading it."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None or size == 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // _PAGE)
            resident = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, resident) != 0:
                return None
            return sum(b & 1 for b in bytes(resident)) / pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def drop_cached(path: Path | str) -> bool:
    """Ask the kernel to drop ``path``'s pages from the page cache (after flushing any it
    still has to write). Whether it did: see ``cached_fraction``. False where not supported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True
