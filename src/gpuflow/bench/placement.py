"""Child processes placed on devices: a queue of jobs over a set of slots, each child's output
read line by line with the seconds since it started.

A slot is the environment one child gets on top of the common one and its job's own
(``CUDA_VISIBLE_DEVICES`` naming one GPU, or nothing: the children then run one after another
in one slot). With as
many slots as jobs every job starts at once; otherwise each waits for a slot to free up. A
child that fails stops the others; so do Ctrl-C and SIGTERM (``sigterm_as_interrupt``).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpuflow.bench.scale import last_words, sigterm_as_interrupt, stop_child
from gpuflow.common.errors import GpuflowError
from gpuflow.common.signals import interrupts_deferred

# How often the queue looks for a child that ended: far below any child's start-up.
POLL_S = 0.2


@dataclass(frozen=True)
class Job:
    label: str  # in messages and errors: "nanoGPT", "gpuflow seed 1338"
    command: list[str]
    log: Path  # where its output goes, each line behind the seconds since it started
    env: dict[str, str] = field(default_factory=dict)  # its own, on top of the common one


@dataclass
class Finished:
    """A child that ended: its exit status, seconds from start to exit, and every line it
    wrote (stdout and stderr as one stream) with the seconds since it started."""

    job: Job
    returncode: int
    seconds: float
    slot: dict[str, str]
    lines: list[tuple[float, str]] = field(default_factory=list)


class _Running:
    """One started child and the thread that reads its output: a pipe nobody reads while
    the child runs would fill and stall it."""

    def __init__(self, job: Job, cwd: Path, env: dict[str, str], slot: dict[str, str]) -> None:
        self.job, self.slot = job, slot
        self.lines: list[tuple[float, str]] = []
        self._log: IO[str] = open(job.log, "w", encoding="utf-8")  # noqa: SIM115 - closed by finish
        self.started = time.perf_counter()
        # A session of its own: Ctrl-C reaches the bench alone, which then stops the child.
        self.child = subprocess.Popen(
            job.command, cwd=cwd, env={**env, **job.env, **slot}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ended: float | None = None

    def _read(self) -> None:
        assert self.child.stdout is not None
        for raw in self.child.stdout:
            at = time.perf_counter() - self.started
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.lines.append((at, text))
            self._log.write(f"[{at:10.3f}] {text}\n")

    def poll(self) -> bool:
        """Whether the child has ended (its exit time noted when first seen)."""
        if self.ended is None and self.child.poll() is not None:
            self.ended = time.perf_counter()
        return self.ended is not None

    def finish(self) -> Finished:
        """The ended child's record, once its last lines are read."""
        self.child.wait()
        self.poll()
        self._reader.join()
        self._log.close()
        assert self.ended is not None
        seconds = self.ended - self.started
        return Finished(self.job, self.child.returncode, seconds, self.slot, self.lines)


def run_jobs(
    jobs: Sequence[Job], slots: Sequence[dict[str, str]], cwd: Path, env: dict[str, str],
    owner: str, said: Callable[[str], None] = lambda message: None,
) -> list[Finished]:  # fmt: skip
    """Run ``jobs`` in order over ``slots``, at most one child per slot at a time; their
    records, in the jobs' order. A child that exits non-zero stops the others and raises one
    line naming ``owner`` (``bench reference``), the child and its last words. ``said`` hears
    when each starts and ends."""
    if not slots:
        raise ValueError("run_jobs needs at least one slot")
    pending = deque(enumerate(jobs))
    free = list(slots)
    running: dict[int, _Running] = {}
    done: dict[int, Finished] = {}
    try:
        with sigterm_as_interrupt():
            while pending or running:
                while pending and free:
                    number, job = pending.popleft()
                    slot = free.pop(0)
                    with interrupts_deferred():  # until the child is in `running`, to be stopped
                        running[number] = _Running(job, cwd, env, slot)
                    gpu = slot.get("CUDA_VISIBLE_DEVICES")
                    where = f" on GPU {gpu}" if gpu is not None else ""
                    said(f"[{number + 1}/{len(jobs)}] {job.label}: started{where}")
                time.sleep(POLL_S)
                for number in [n for n, child in running.items() if child.poll()]:
                    finished = running.pop(number).finish()
                    free.append(finished.slot)
                    if finished.returncode != 0:
                        raise GpuflowError(failure_line(owner, finished))
                    done[number] = finished
                    said(f"[{number + 1}/{len(jobs)}] {finished.job.label}: ended after "
                         f"{finished.seconds:.1f} s")  # fmt: skip
    finally:
        for child in running.values():  # after a failure, Ctrl-C or SIGTERM
            stop_child(child.child)
            child.finish()
    return [done[n] for n in range(len(jobs))]


def failure_line(owner: str, finished: Finished) -> str:
    """One line for a failed child: its label, its exit status and its own last words."""
    output = "\n".join(text for _, text in finished.lines)
    return (
        f"{owner}: {finished.job.label} failed (exit status {finished.returncode}): "
        f"{last_words(output)}"
    )
