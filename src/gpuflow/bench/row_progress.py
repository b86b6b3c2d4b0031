"""How far a training run in a child process has come, read from its ``metrics.jsonl``.

A bench that runs ``gpuflow train`` in a child sees nothing of it until it ends, and a row of
a large preset can take most of an hour: its status line shows the run's last logged step and
the time its steps so far say is left.
"""

from __future__ import annotations

import json
from contextlib import suppress
from pathlib import Path

from gpuflow.train.runfolder import METRICS_FILE

TAIL_BYTES = 1 << 14  # the end of the file read: several records, each under a kilobyte


def progress_line(run_dir: Path, planned_steps: int) -> str:
    """The run's last logged step of ``planned_steps`` and the time left at the pace of its
    last two training records ("step k/N, about T left"); "starting" before its first (the
    run compiles and warms up first)."""
    records = _last_records(Path(run_dir) / METRICS_FILE)
    trained = [r for r in records if "loss" in r and "elapsed_s" in r]
    if not trained:
        return "starting"
    last = trained[-1]
    line = f"step {last['step']:,}/{planned_steps:,}"
    if len(trained) >= 2:
        before = trained[-2]
        steps = last["step"] - before["step"]
        if steps > 0:
            per_step = (last["elapsed_s"] - before["elapsed_s"]) / steps
            line += f", about {_duration(max(0, planned_steps - last['step']) * per_step)} left"
    return line


def _last_records(path: Path) -> list[dict]:
    """The whole JSON records in the last ``TAIL_BYTES`` of ``path`` (none if it is missing);
    a line cut by the read's start, or still being written, is left out."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return []
    lines = tail.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # begins part way through a record
    records = []
    for line in lines:
        with suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
