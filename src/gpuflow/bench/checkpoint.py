"""``gpuflow bench checkpoint``: how long a checkpoint stops training, blocking vs async.

Timed windows of the same steps, one checkpoint saved after a window's first step in one of
three ways (``pytorch``: the state dict copied to the host and written on the training
thread; ``blocking``: gpuflow's snapshot and writer on the training thread; ``async``:
gpuflow's ``Checkpointer``); a window's stall is its time less that of the plain windows
around it. Details: docs/architecture/benches.md (gpuflow bench checkpoint).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from gpuflow.common.console import err_console
from gpuflow.device.accelerator import Device
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig, resolve_config
from gpuflow.train.datapath import resolve_data_path
from gpuflow.train.trainer import Trainer, run_steps

KINDS = ("pytorch", "blocking", "async")


@dataclass(frozen=True)
class CheckpointBenchConfig:
    preset: str = "gpt2-124m"
    warmup: int = 10
    window: int = 10  # steps per timed window; the save comes after its first step
    rounds: int = 3
    overrides: tuple[str, ...] = ()


def _pytorch_save(folder: Path, trainer: Trainer) -> None:
    """The usual way: every tensor copied to the host, then the files, on this thread."""
    weights, moments, _ = ckpt.checkpoint_state(trainer.setup.model, trainer.setup.optimizer)
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in (("model", weights), ("optimizer", moments)):
        path = folder / f"{name}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def run_checkpoint_bench(device: Device, bench: CheckpointBenchConfig) -> dict[str, Any]:
    steps = bench.warmup + bench.window * (2 * len(KINDS) + 1) * bench.rounds + 100
    config = resolve_config(bench.preset, None, [*bench.overrides, f"train.steps={steps}"])
    path, _ = resolve_data_path(config.train.data_path, device, config.train.allocator)
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-checkpoint-"))
    try:
        with err_console.status(f"measuring checkpoint saves of {bench.preset}..."):
            result = _measure(config, device, scratch, bench)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "preset": bench.preset,
        "data_path": str(path),
        "config": {
            "warmup": bench.warmup,
            "window": bench.window,
            "rounds": bench.rounds,
            "overrides": bench.overrides,
        },
        **result,
    }


def _measure(
    config: RunConfig, device: Device, scratch: Path, bench: CheckpointBenchConfig
) -> dict[str, Any]:
    trainer = Trainer(config, scratch / "run", device)
    trainer.build(resume=False, say=lambda note: None)  # notes on the run, not on measuring it
    for kind in ("async", "blocking"):  # the runs' folders, as a run's are made before it saves
        (scratch / kind).mkdir()
    background = ckpt.Checkpointer(scratch / "async", device, keep=1)
    blocking = ckpt.Checkpointer(scratch / "blocking", device, keep=1, background=False)
    step = 0
    with trainer.open_step(0, config.train.steps) as step_fn:

        def window(save: Callable[[int], None] | None) -> float:
            """Seconds for ``bench.window`` steps, with ``save`` after the first."""
            nonlocal step
            first = step

            def save_after_the_first(done: int) -> None:
                if done == first and save is not None:
                    save(done + 1)  # the state after step ``done``: ``done + 1`` steps trained

            device.synchronize()
            started = time.perf_counter()
            run_steps(step_fn, first, first + bench.window, save_after_the_first)
            step = first + bench.window
            device.synchronize()
            seconds = time.perf_counter() - started
            step_fn.scalars.flush(step)
            shutil.rmtree(scratch / "pytorch", ignore_errors=True)  # keep the disk from filling
            return seconds

        saves: dict[str, Callable[[int], None]] = {
            "pytorch": lambda done: _pytorch_save(scratch / "pytorch" / f"step_{done}", trainer),
            "blocking": lambda done: trainer.save(blocking, done),
            "async": lambda done: trainer.save(background, done),
        }
        run_steps(step_fn, 0, bench.warmup)
        step = bench.warmup
        for kind in KINDS:  # one untimed save of each: first-use allocations stay out
            window(saves[kind])
            background.wait()
        plain: list[float] = []
        stalls: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(bench.rounds):
            for kind in KINDS:
                before = window(None)
                with_save = window(saves[kind])
                background.wait()  # the write finishes outside the windows it overlaps
                after = window(None)
                plain += [before, after]
                stalls[kind].append(with_save - statistics.median([before, after]))
        step_fn.scalars.drain(step)
    background.close()
    blocking.close()
    step_s = statistics.median(plain) / bench.window
    state_bytes = sum(
        t.numel() * t.element_size()
        for part in ckpt.checkpoint_state(trainer.setup.model, trainer.setup.optimizer)[:2]
        for t in part.values()
    )
    written = background.written[-1]
    file_bytes = sum(p.stat().st_size for p in written.iterdir())
    write_s = statistics.median(background.write_seconds)
    rows = [
        {
            "kind": kind,
            "stall_ms": statistics.median(stalls[kind]) * 1e3,
            "stall_steps": statistics.median(stalls[kind]) / step_s,
            "stall_ms_rounds": [s * 1e3 for s in stalls[kind]],
        }
        for kind in KINDS
    ]
    return {
        "step_ms": step_s * 1e3,
        "tokens_per_step": trainer.tokens_per_step,
        "state_bytes": state_bytes,
        "file_bytes": file_bytes,
        "async_write_s": write_s,
        "async_write_gb_s": file_bytes / write_s / 1e9,
        "rows": rows,
    }


def print_checkpoint_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    out = table(
        "save",
        "training stall",
        "in steps",
        title=(
            f"{result['preset']} ({result['data_path']}): one checkpoint of "
            f"{result['file_bytes'] / 1e6:,.0f} MB, step {result['step_ms']:.2f} ms"
        ),
    )
    for row in result["rows"]:
        out.add_row(row["kind"], f"{row['stall_ms']:,.1f} ms", f"{row['stall_steps']:.2f}")
    out_console.print(out)
    out_console.print(
        f"the async write took {result['async_write_s']:.2f} s "
        f"({result['async_write_gb_s']:.2f} GB/s) while training went on"
    )
