"""``gpuflow profile``: training steps under the profiler and the ledger, then a report.

Writes ``trace.json`` (the profiler's trace of the timed steps), ``timeline.png`` (device
activity per stream and bytes per step) and ``profile.json`` (the ledger's totals and
per-step figures, the profiler cross-check, the transfer metrics). The output folder must be
new, empty, or an earlier profile's (``profile_folder``: how one is told from a folder of the
user's, and how the files are written). What it runs, and what it shows on the CPU:
docs/architecture/benches.md (gpuflow profile). The notices torch's profiler prints at each
start and stop are kept out of the user's terminal (``profiler_notices_dropped``).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpuflow.accounting.crosscheck import DeviceTrace, Interval, ProfiledLedger
from gpuflow.accounting.kernels import kernel_breakdown, step_flops
from gpuflow.accounting.metrics import TransferMetrics, from_activity
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.device.linkprobe import probe_link
from gpuflow.interface.profile_folder import OUTPUT_FILES as OUTPUT_FILES  # the cli lists them
from gpuflow.interface.profile_folder import TRACE_FILE, profile_folder, write_profile
from gpuflow.train.config import RunConfig, apply_overrides
from gpuflow.train.datapath import DataPath, registered
from gpuflow.train.trainer import Trainer, run_steps

# What torch's profiler (kineto) writes to stderr itself at each start and stop, whatever
# its log level: "USDT:2026-11-28 05:53:47 18906:18906 SyncActivityProfilerHandler.cpp:52]
# profiler_start" (and STAGE: lines alike).
PROFILER_NOTICE = re.compile(rb"(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")
HOST_ONLY_NOTE = (
    "on the cpu there is no device to trace: the step time is the host's, and the timeline, "
    "link utilisation and overlap need an accelerator; the ledger's counts hold as on one"
)


@contextmanager
def profiler_notices_dropped() -> Iterator[None]:
    """This process's stderr held while the profiler runs, then passed on less the
    profiler's own notices. Held at the file descriptor: the profiler writes from C++."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if not PROFILER_NOTICE.match(line))
            if kept:
                os.write(2, kept)


def profile_training(
    config: RunConfig, out_dir: Path, device: Device, steps: int = 10, warmup: int = 5
) -> dict[str, Any]:
    """Profile ``steps`` steps after ``warmup`` untimed ones into ``out_dir``; returns what
    profile.json holds. The folder is checked and locked before the steps run, and its
    files are written only once they all exist (``profile_folder``)."""
    if steps < 1 or warmup < 0:
        raise GpuflowError(f"profile needs --steps >= 1 and --warmup >= 0, got {steps}, {warmup}")
    config = apply_overrides(config, {"train": {"steps": warmup + 2 * steps}}, "profile")
    out_dir = Path(out_dir)
    with profile_folder(out_dir), tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / TRACE_FILE  # copied in once the profile is whole
        result, activity = _measure(config, out_dir, device, steps, warmup, trace)
        timeline = _plot(activity, result["ledger"]["per_step"]) if activity else None
        return write_profile(out_dir, result, trace, timeline)


def _measure(
    config: RunConfig, out_dir: Path, device: Device, steps: int, warmup: int, trace: Path
) -> tuple[dict[str, Any], list[Interval]]:
    """The figures of profile.json, and the device's activity in the timed steps (none on the
    cpu); the profiler's trace of those steps is written to ``trace``."""
    if not registered(config.train.data_path):  # a baseline: the bench registers it
        import gpuflow.bench.baselines  # noqa: F401
    trainer = Trainer(config, out_dir, device)
    trainer.build(resume=False, say=lambda note: None)  # notes on the run, not on measuring it
    peak = probe_link(device).get("h2d_pinned")
    mode = trainer.setup.path
    if trainer.setup.path_note:
        err_console.print(trainer.setup.path_note)

    total = warmup + 2 * steps
    with ExitStack() as stack:
        # A streamed pass gets a loader of its own, so that every copy its steps use is made
        # inside the region (a loader running since an earlier region would have prefetched
        # its first batches before the profiler started). Other paths upload or capture once,
        # before the regions, and keep their batches.
        shared = None
        if mode is not DataPath.STREAMED:
            shared = stack.enter_context(trainer.open_step(0, total))

        def train(first: int, count: int, after_step: Callable[[int], None] | None = None) -> None:
            with ExitStack() as own:
                train_step = shared or own.enter_context(trainer.open_step(first, first + count))
                run_steps(train_step, first, first + count, after_step)
                train_step.scalars.drain(first + count)

        train(0, warmup)
        # Counting every operation slows the host, so the ledger and the timing get a pass
        # each: first the ledger inside the profiler (the cross-check), then the profiler alone.
        with profiler_notices_dropped(), tempfile.TemporaryDirectory() as scratch:
            counted = ProfiledLedger(Path(scratch) / "trace.json", device)
            with counted:
                train(warmup, steps, lambda step: counted.step())
        timed = DeviceTrace(trace, device)
        with profiler_notices_dropped(), timed:
            host_started = time.perf_counter()
            train(warmup + steps, steps)
            host_seconds = time.perf_counter() - host_started

    summary = counted.ledger.summary()
    totals = summary.totals
    traced = bool(timed.activity)  # device kernels and copies: none on the cpu
    metrics = from_activity(
        timed.activity,
        wall_us=_device_span(timed.activity) if traced else host_seconds * 1e6,
        steps=steps,
        bytes_moved=totals.h2d_bytes + totals.d2h_bytes,
        useful_bytes=steps * trainer.setup.batching.rows * (config.model.max_len + 1) * 2,
        peak_h2d_gb_s=peak,
    )
    result = {
        "preset": config.preset,
        "data_path": str(mode),
        "device": device.describe(),
        "steps": steps,
        "warmup": warmup,
        "ledger": {
            "totals": totals.as_dict(),
            "per_step": [s.as_dict() for s in summary.steps],
            "top_by_bytes": summary.top_by_bytes,
            "top_by_syncs": summary.top_by_syncs,
        },
        "crosscheck": [asdict(row) | {"agrees": row.agrees} for row in counted.comparison()],
        # Each kernel group's device time per step (and rate where its FLOPs are known).
        "kernels": kernel_breakdown(
            timed.activity,
            steps,
            step_flops(
                config.model.d_model,
                config.model.n_layer,
                config.model.max_len,
                config.model.vocab_size,
                trainer.tokens_per_step,
            ),
        ).as_dict(),
        "metrics": _metrics_dict(metrics, summary, traced),
        "step_clock": "device" if traced else "host",
        "note": None if traced else HOST_ONLY_NOTE,
    }
    return result, timed.activity


def _device_span(activity: list[Interval]) -> float:
    if not activity:
        return 0.0
    return max(a.end for a in activity) - min(a.start for a in activity)


def _metrics_dict(m: TransferMetrics, summary: Any, traced: bool) -> dict[str, Any]:
    """``traced``: the device's kernels and copies were seen; else (the cpu) the figures that
    need them are None, not 0."""
    untraced = {"transfer_overhead", "overlap_efficiency", "transfer_ms", "exposed_transfer_ms",
                "compute_ms"}  # fmt: skip
    figures = {
        "step_ms": m.step_us / 1e3,
        "transfer_ms": m.transfer_us / 1e3,
        "exposed_transfer_ms": m.exposed_transfer_us / 1e3,
        "compute_ms": m.compute_us / 1e3,
        "link_utilisation": m.link_utilisation,
        "achieved_h2d_gb_s": m.achieved_h2d_gb_s,
        "peak_h2d_gb_s": m.peak_h2d_gb_s,
        "transfer_overhead": m.transfer_overhead,
        "memory_efficiency": m.memory_efficiency,
        "overlap_efficiency": m.overlap_efficiency,
        "h2d_bytes_per_batch": summary.median("h2d_bytes"),
        "d2h_bytes_per_batch": summary.median("d2h_bytes"),
        "transfer_bytes_per_batch": summary.median("h2d_bytes") + summary.median("d2h_bytes"),
        "syncs_per_batch": summary.median("syncs"),
        "device_allocs_per_batch": summary.median("device_allocs"),
        "allocator_requests_per_batch": summary.median("allocator_requests"),
    }
    return figures if traced else {k: None if k in untraced else v for k, v in figures.items()}


def _plot(activity: list[Interval], per_step: list[dict[str, int]]) -> bytes:
    """The timeline as PNG bytes: written by ``write_profile``, as a temporary renamed into
    place (matplotlib would write the file in place, through a link there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), height_ratios=(2, 1))
    colours = {"kernel": "tab:blue", "h2d": "tab:orange", "d2h": "tab:red", "d2d": "tab:gray"}
    streams = sorted({a.stream for a in activity})
    origin = min((a.start for a in activity), default=0.0)
    for row, stream in enumerate(streams):
        for kind, colour in colours.items():
            spans = [
                ((a.start - origin) / 1e3, max((a.end - a.start) / 1e3, 1e-3))
                for a in activity
                if a.stream == stream and a.kind == kind
            ]
            if spans:
                top.broken_barh(spans, (row - 0.4, 0.8), color=colour, label=kind)
    handles = {h.get_label(): h for h in top.get_legend_handles_labels()[0]}
    top.legend(handles.values(), handles.keys(), loc="upper right")
    top.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    top.set_xlabel("ms")
    top.set_title("device activity: kernels (compute) and copies, per stream")
    steps = range(1, len(per_step) + 1)
    bottom.bar(steps, [s["h2d_bytes"] for s in per_step], label="host→device", color="tab:orange")
    bottom.bar(
        steps,
        [s["d2h_bytes"] for s in per_step],
        bottom=[s["h2d_bytes"] for s in per_step],
        label="device→host",
        color="tab:red",
    )
    bottom.set_xlabel("step")
    bottom.set_ylabel("bytes")
    bottom.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()
