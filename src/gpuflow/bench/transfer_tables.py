"""How ``gpuflow bench transfer``'s results read: a table for each section measured, then
the targets, each met or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

KB, MB = 1 << 10, 1 << 20

# The bench's sections, in the order they run and print (here, where the command line reads
# them without loading torch).
SECTIONS = (
    "peak", "memory_kinds", "small_tensors", "payloads", "loader_sweep", "loader_cases",
    "image_loop", "text_loop", "flat_memory",
)  # fmt: skip


def print_transfer_tables(r: dict[str, Any]) -> None:
    """A table for each section measured, then the targets."""
    from gpuflow.common.console import out_console, table

    peak = r["peak"]["h2d_gb_s"] if "peak" in r else 0.0

    def of_peak(rate: float) -> str:
        return f"{rate:.2f} ({rate / peak:.0%})" if peak else f"{rate:.2f}"

    printers: dict[str, Callable[[], None]] = {
        "peak": lambda: _print_peak(r),
        "memory_kinds": lambda: _print_memory_kinds(r, of_peak),
        "small_tensors": lambda: _print_small_tensors(r),
        "payloads": lambda: _print_payloads(r, of_peak),
        "loader_sweep": lambda: _print_sweep(r, of_peak),
        "loader_cases": lambda: _print_cases(r),
        "image_loop": lambda: _print_image_loop(r),
        "text_loop": lambda: _print_text_loop(r),
    }
    for name, show in printers.items():
        if name in r:
            show()
    if "flat_memory" in r:
        fm = r["flat_memory"]
        out_console.print(
            f"memory after 100 and {fm['iterations']} loader iterations, and after epochs 2 "
            f"and {fm['epochs']}: {'flat' if fm['flat'] else 'GREW'} ({fm['after_100']})"
        )
    grid = table("target", "measured", "goal", "met", title="targets")
    for t in r["targets"]:
        met = t["value"] >= t["goal"]
        grid.add_row(
            t["target"],
            f"{t['value']:.3g}",
            f"{t['goal']:.3g}",
            "yes" if met else "[bold red]no[/]",
        )
    out_console.print(grid)


def _print_peak(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console

    out_console.print(
        f"pinned peak at {r['peak']['bytes'] >> 20} MiB: host->device "
        f"{r['peak']['h2d_gb_s']:.1f} GB/s, device->host {r['peak']['d2h_gb_s']:.1f} GB/s"
    )


def _print_memory_kinds(r: dict[str, Any], of_peak: Callable[[float], str]) -> None:
    from gpuflow.common.console import out_console, table

    grid = table(
        "size",
        *(f"{d} {m}" for d in ("h2d", "d2h") for m in ("pageable", "fresh pinned", "pooled")),
        title="GB/s by memory kind (fraction of the pinned h2d peak)",
    )
    sizes = sorted({row["bytes"] for row in r["memory_kinds"]})
    lookup = {(row["direction"], row["memory"], row["bytes"]): row for row in r["memory_kinds"]}
    for n in sizes:
        cells = [
            of_peak(lookup[(d, m, n)]["gb_s"])
            for d in ("h2d", "d2h")
            for m in ("pageable", "fresh_pinned", "pooled")
        ]
        grid.add_row(size_label(n), *cells)
    out_console.print(grid)


def _print_small_tensors(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    s = r["small_tensors"]
    grid = table(
        "path",
        "ms",
        "vs one by one, pageable / pinned",
        title=(f"{s['tensors']} tensors of {size_label(s['bytes_each'])} to the device"),
    )
    grid.add_row("one by one, pageable", f"{s['separate_pageable_ms']:.3f}", "")
    grid.add_row("one by one, pinned", f"{s['separate_pinned_ms']:.3f}", "")
    grid.add_row(
        "packed: plan + pack + 1 copy + rebuild",
        f"{s['packed_ms']:.3f}",
        f"{s['speedup_vs_pageable']:.1f}x / {s['speedup_vs_pinned']:.1f}x",
    )
    grid.add_row(
        "in bulk: one stacked tensor, 1 copy, rebuilt as a view",
        f"{s['bulk_ms']:.3f}",
        f"{s['bulk_speedup_vs_pageable']:.1f}x / {s['bulk_speedup_vs_pinned']:.1f}x",
    )
    grid.add_row(
        f"  the same, unbound into {s['tensors']} tensors",
        f"{s['bulk_unbound_ms']:.3f}",
        f"{s['bulk_unbound_speedup_vs_pageable']:.1f}x / "
        f"{s['bulk_unbound_speedup_vs_pinned']:.1f}x",
    )
    out_console.print(grid)


def _print_payloads(r: dict[str, Any], of_peak: Callable[[float], str]) -> None:
    from gpuflow.common.console import out_console, table

    grid = table(
        "payload",
        "wire bytes",
        "ms",
        "effective GB/s",
        "vs fp32",
        "host convert ms",
        title="the same values as fp32, bf16 and uint8 (upcast on the device included)",
    )
    for row in r["payloads"]:
        grid.add_row(
            row["payload"],
            size_label(row["wire_bytes"]),
            f"{row['ms']:.3f}",
            of_peak(row["effective_gb_s"]),
            f"{row['vs_fp32']:.2f}x",
            f"{row['host_convert_ms']:.1f}",
        )
    out_console.print(grid)


def _print_sweep(r: dict[str, Any], of_peak: Callable[[float], str]) -> None:
    from gpuflow.common.console import out_console, table

    grid = table(
        "batch",
        "source",
        "DataLoader(pin) + .to",
        ".pin_memory().to",
        ".to()",
        "DeviceLoader",
        "vs fastest idiom",
        "fresh_batches",
        "loader host us/batch",
        title="GB/s per path, a little compute per batch (fraction of the pinned h2d peak)",
    )
    for row in r["loader_sweep"]:
        grid.add_row(
            size_label(row["batch_bytes"]),
            row["source"],
            *(of_peak(row[f"{name}_gb_s"]) for name in ("dataloader", "pin_to", "to")),
            of_peak(row["deviceloader_gb_s"]),
            f"{row['vs_fastest_idiom']:.2f}x",
            f"{row['fresh_vs_fastest_idiom']:.2f}x",
            f"{row['deviceloader_host_us_per_batch']:.1f}",
        )
    out_console.print(grid)


def _print_cases(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    grid = table(
        "case",
        "DataLoader(pin) + .to",
        ".pin_memory().to",
        ".to()",
        "DeviceLoader",
        "vs fastest idiom",
        "no codecs",
        title="batches/s where the idiom is worse by its structure (each batch read once)",
    )
    for row in r["loader_cases"]:
        grid.add_row(
            row["case"],
            *(f"{row[f'{name}_batches_s']:,.0f}" for name in ("dataloader", "pin_to", "to")),
            f"{row['deviceloader_batches_s']:,.0f}",
            f"{row['vs_fastest_idiom']:.2f}x",
            f"{row['plain_vs_fastest_idiom']:.2f}x",
        )
    out_console.print(grid)


def _print_image_loop(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    grid = table(
        "batch",
        "DataLoader(pin_memory=True) + .to",
        "DeviceLoader(DataLoader)",
        "speedup",
        title="image classification loop, images/s (workers, uint8 images, small CNN, bf16)",
    )
    for row in r["image_loop"]:
        grid.add_row(
            f"{row['batch_size']} ({row['batch_bytes'] / 1e6:.1f} MB)",
            f"{row['dataloader_images_s']:,.0f}",
            f"{row['deviceloader_images_s']:,.0f}",
            f"{row['speedup']:.2f}x",
        )
    out_console.print(grid)
    for row in r["image_loop"]:
        out_console.print(
            _feeds_alone(row, f"at {row['batch_bytes'] / 1e6:.1f} MB", "dataloader", ".to")
        )


def _print_text_loop(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    row = r["text_loop"]
    grid = table(
        "batch",
        ".pin_memory().to",
        "DeviceLoader",
        "speedup",
        title="text loop, tokens/s (int64 ids cut from a uint16 token array, small transformer)",
    )
    grid.add_row(
        f"{row['batch']} x {row['context']} ({size_label(row['batch_bytes'])})",
        f"{row['pin_to_tokens_s']:,.0f}",
        f"{row['deviceloader_tokens_s']:,.0f}",
        f"{row['speedup']:.2f}x",
    )
    out_console.print(grid)
    which = f"at {size_label(row['batch_bytes'])}"
    out_console.print(_feeds_alone(row, which, "pin_to", ".pin_memory().to"))


def _feeds_alone(row: dict[str, Any], which: str, idiom: str, label: str) -> str:
    """One line of a loop's feeds timed alone (``feed_figures``)."""
    feed = row["feed_us"]
    return (
        f"the feeds alone {which}, host us per batch: {label} {feed[idiom]:.1f}, DeviceLoader "
        f"{feed['deviceloader']:.1f}, the source alone {feed['source_alone']:.1f}; "
        f"DeviceLoader's extra is {row['feed_extra_share']:+.1%} of a {row['step_ms']:.2f} ms "
        "step"
    )


def size_label(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``16 MiB``, ``4 KiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MB), ("KiB", KB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
