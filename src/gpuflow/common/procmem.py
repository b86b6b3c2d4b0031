"""A process's resident memory and the host's available memory, read from Linux's /proc
(None elsewhere, or once the process ended)."""

from __future__ import annotations

import os

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(pid: int | str = "self") -> int | None:
    """The resident set size of process ``pid`` (default: this one) in bytes; None where there
    is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def available_bytes() -> int | None:
    """The memory the host can give a process without swapping (MemAvailable); None where
    there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
