"""The resident memory of a process and of every process below it, sampled from ``/proc``
on a thread of the caller: each process's peak, and the peak of their sum.

    watch = TreeMemory(child.pid)
    ...                                  # the child runs, starts workers, ends
    peaks = watch.stop()                 # peaks.total, peaks.largest, peaks.each[pid]

A process that lives less than one interval may be missed, and a peak between two samples
is not seen: the figures are lower bounds. Off Linux nothing is sampled (all zeros).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from gpuflow.common.procmem import resident_bytes


@dataclass
class TreePeaks:
    root: int
    total: int = 0  # the peak of the tree's summed resident memory, bytes
    each: dict[int, int] = field(default_factory=dict)  # pid: its peak, bytes

    @property
    def largest(self) -> int:
        """The peak of the process that peaked highest."""
        return max(self.each.values(), default=0)

    @property
    def others(self) -> list[int]:
        """The peaks of the processes below the root, highest first."""
        return sorted((v for pid, v in self.each.items() if pid != self.root), reverse=True)


class TreeMemory:
    """Samples the tree under ``pid`` every ``every`` seconds until ``stop``."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.every = every
        self.peaks = TreePeaks(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def stop(self) -> TreePeaks:
        self._done.set()
        self._thread.join()
        return self.peaks

    def _watch(self) -> None:
        while not self._done.is_set():
            sample = tree_rss(self.peaks.root)
            for pid, rss in sample.items():
                self.peaks.each[pid] = max(self.peaks.each.get(pid, 0), rss)
            self.peaks.total = max(self.peaks.total, sum(sample.values()))
            self._done.wait(self.every)


def tree_rss(root: int) -> dict[int, int]:
    """The resident bytes of ``root`` and of each process below it, now; {} without /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                # The name may hold spaces and parentheses: the fields follow its last ")".
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        children.setdefault(parent, []).append(int(entry))
    rss: dict[int, int] = {}
    queue = [root]
    while queue:
        pid = queue.pop()
        resident = resident_bytes(pid)
        if resident is None:
            continue  # it ended meanwhile
        rss[pid] = resident
        queue += children.get(pid, [])
    return rss
