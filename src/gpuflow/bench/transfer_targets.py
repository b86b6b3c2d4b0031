"""What ``gpuflow bench transfer`` holds its results to: each target as a row of ``TARGETS``,
and the measured value of each beside its goal (``targets``).

A target reads every row of one section (a section of one result: that result) that it
applies to; its value over its goal is met at 1 or more, so a ceiling is stated as goal over
value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuflow.bench.transfer_tables import KB, MB, size_label

Row = dict[str, Any]


def _field(key: str) -> Callable[[Row, float], Any]:
    return lambda row, peak: row[key]


def _every(row: Row, peak: float) -> bool:
    return True


@dataclass(frozen=True)
class Target:
    """One goal: a name, how to read its value off a section's row, and the goal."""

    section: str  # the result it reads
    # formatted with the row's fields, ``size`` (its batch_bytes as ``size_label`` writes
    # them) and ``mb`` (its batch_bytes in MB)
    name: str
    value: Callable[[Row, float], Any]  # (row, the pinned host-to-device peak) -> measured
    goal: float
    applies: Callable[[Row, float], bool] = _every  # (row, peak) -> whether it is held to it


TARGETS: tuple[Target, ...] = (
    Target(
        "loader_sweep", "DeviceLoader >= fastest PyTorch idiom, {size} {source}",
        _field("vs_fastest_idiom"), 1.0,
    ),
    Target(
        "loader_sweep", "DeviceLoader >= 90% of pinned h2d peak, {size} pinned",
        lambda row, peak: row["deviceloader_gb_s"] / peak, 0.9,
        lambda row, peak: bool(peak) and row["source"] == "pinned"
        and row["batch_bytes"] >= 16 * MB,
    ),
    Target(  # a ceiling
        "loader_sweep", "DeviceLoader host time <= 30 us per 8 KiB batch ({source})",
        lambda row, peak: 30.0 / row["deviceloader_host_us_per_batch"], 1.0,
        lambda row, peak: row["batch_bytes"] == 8 * KB,
    ),
    Target(
        "loader_cases", "DeviceLoader >= 1.5x fastest idiom, {case}",
        _field("vs_fastest_idiom"), 1.5,
    ),
    Target(
        "image_loop",
        "image loop, DeviceLoader >= 0.98x DataLoader(pin_memory=True), {mb:.1f} MB batches",
        _field("speedup"), 0.98,
    ),
    Target(
        "text_loop", "text loop, DeviceLoader >= 0.98x pin_memory().to(), {size} batches",
        _field("speedup"), 0.98,
    ),
    Target(
        "text_loop",
        "text loop, the idiom's step over the step plus DeviceLoader's host time per batch "
        "beyond the idiom's (the feeds timed alone) >= 0.98x",
        lambda row, peak: 1 / (1 + row["feed_extra_share"]), 0.98,
    ),
    Target(
        "small_tensors", "packed small tensors >= 4x separate copies (pageable)",
        _field("speedup_vs_pageable"), 4.0,
    ),
    Target(
        "small_tensors", "small tensors in bulk, rebuilt as one view, >= 20x separate copies",
        _field("bulk_speedup_vs_pageable"), 20.0,
    ),
    Target(
        "payloads", "bf16 payload >= 1.8x fp32 effective rate",
        _field("vs_fp32"), 1.8,
        lambda row, peak: row["payload"] == "bf16",
    ),
    Target(
        "flat_memory", "pinned and device memory flat over 10,000 iterations and 20 epochs",
        lambda row, peak: float(row["flat"]), 1.0,
    ),
)  # fmt: skip


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target the measured sections speak to, in ``TARGETS``' order, with its value
    and goal."""
    peak = results["peak"]["h2d_gb_s"] if "peak" in results else 0.0
    out: list[dict[str, Any]] = []
    for target in TARGETS:
        measured = results.get(target.section, [])
        for row in [measured] if isinstance(measured, dict) else measured:
            if target.applies(row, peak):
                out.append(
                    {
                        "target": target.name.format_map({**row, **_sizes(row)}),
                        "value": target.value(row, peak),
                        "goal": target.goal,
                    }
                )
    return out


def _sizes(row: Row) -> dict[str, Any]:
    """The names' size fields of a row with ``batch_bytes``."""
    if "batch_bytes" not in row:
        return {}
    return {"size": size_label(row["batch_bytes"]), "mb": row["batch_bytes"] / 1e6}
