"""``gpuflow bench soak``: a long run, to show that nothing grows.

Trains a preset for ``steps`` steps as ``gpuflow train`` would (its data path, evaluations,
async and best checkpoints) in a scratch folder, and reads back the memory sample each
logging record carries: the process's resident host memory, pinned host memory, device
memory allocated and reserved by the caching allocator, and its cudaMalloc calls so far.
Warm-up lasts until the first checkpoint and the first evaluation are behind (each pins or
allocates its buffers once); after it, each series should be flat. The allocator's figures
are exact, so any rise over the first sample after warm-up counts; resident host memory
swings by tens of MB as Python's heap and the OS's page accounting move, so there the
median of the last quarter of the samples is compared with that of the first quarter,
against a tolerance. Writes the series, the verdicts and a plot.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.trainer import Trainer

# series -> (label, growth allowed after warm-up in bytes or calls)
SERIES = {
    "rss_bytes": ("host resident memory", 64 << 20),
    "pinned_bytes": ("pinned host memory", 0),
    "device_allocated_bytes": ("device memory allocated", 0),
    "device_reserved_bytes": ("device memory reserved", 0),
    "device_mallocs": ("cudaMalloc calls", 0),
}


@dataclass(frozen=True)
class SoakConfig:
    preset: str = "tiny"
    steps: int = 10_000
    overrides: tuple[str, ...] = ()


def run_soak(device: Device, soak: SoakConfig) -> dict[str, Any]:
    config = resolve_config(soak.preset, None, [*soak.overrides, f"train.steps={soak.steps}"])
    tc = config.train
    warm_until = max(tc.checkpoint_interval, tc.eval_interval) + tc.log_interval
    # two memory samples after the warm-up, each taken at a logging step, at the least
    enough = -(-warm_until // tc.log_interval) * tc.log_interval + tc.log_interval
    if soak.steps < enough:
        raise GpuflowError(
            f"bench soak: {soak.steps} steps end before two memory samples follow the warm-up "
            f"(to step {warm_until}: the first checkpoint and evaluation, and a logging "
            f"interval), so nothing would be measured; give --steps {enough} or more, or "
            "lower train.checkpoint_interval and train.eval_interval with --set"
        )
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-soak-"))
    try:
        result = Trainer(config, scratch / "run", device).run()
        records = [r for r in read_metrics(scratch / "run") if "loss" in r]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    samples = {
        name: [(r["step"], r[name]) for r in records if r.get(name) is not None] for name in SERIES
    }
    verdicts = {}
    for name, (label, allowed) in SERIES.items():
        after = [value for step, value in samples[name] if step >= warm_until]
        if len(after) < 2:
            continue  # this device does not report it (pinned and device figures off CUDA)
        if allowed:  # a noisy series: quarter against quarter
            quarter = max(1, len(after) // 4)
            growth = statistics.median(after[-quarter:]) - statistics.median(after[:quarter])
        else:  # an exact count: any rise
            growth = max(after) - after[0]
        verdicts[name] = {
            "label": label,
            "first_after_warmup": after[0],
            "last": after[-1],
            "max": max(after),
            "growth": growth,
            "allowed": allowed,
            "flat": growth <= allowed,
        }
    if not verdicts:  # (host memory is read on every platform gpuflow runs on)
        raise GpuflowError("bench soak: no memory series was sampled twice after the warm-up")
    return {
        "preset": soak.preset,
        "steps": result.last_step,
        "warmup_steps": warm_until,
        "tokens_per_s": result.tokens_per_s,
        "seconds": result.seconds,
        "overrides": soak.overrides,
        "verdicts": verdicts,
        "samples": samples,
        "flat": all(v["flat"] for v in verdicts.values()),
    }


def plot_soak(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [name for name in SERIES if len(result["samples"][name]) > 1]
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.2 * len(shown)), sharex=True)
    axes = [axes] if len(shown) == 1 else axes
    for ax, name in zip(axes, shown, strict=True):
        steps, values = zip(*result["samples"][name], strict=True)
        scale, unit = (1, "calls") if name == "device_mallocs" else (2**20, "MiB")
        ax.plot(steps, [v / scale for v in values], lw=1)
        ax.axvline(result["warmup_steps"], color="gray", ls=":", lw=1)
        ax.set_ylabel(unit)
        ax.set_title(SERIES[name][0], fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step (dotted: end of warm-up)")
    fig.suptitle(f"gpuflow soak: {result['preset']}, {result['steps']:,} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_soak_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    out = table(
        "after warm-up",
        "first",
        "last",
        "growth",
        "allowed",
        "flat",
        title=(
            f"{result['preset']}: {result['steps']:,} steps, warm-up to step "
            f"{result['warmup_steps']:,}"
        ),
    )
    for verdict in result["verdicts"].values():
        calls = verdict["label"].endswith("calls")
        show = (lambda v: f"{v:,}") if calls else (lambda v: f"{v / 2**20:,.1f} MiB")
        out.add_row(
            verdict["label"],
            show(verdict["first_after_warmup"]),
            show(verdict["last"]),
            show(verdict["growth"]),
            show(verdict["allowed"]),
            "yes" if verdict["flat"] else "[bold red]no[/]",
        )
    out_console.print(out)
