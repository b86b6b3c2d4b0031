"""``gpuflow profile``: training steps under the profiler and the transfer ledger."""

from __future__ import annotations

import argparse
from typing import Any

from gpuflow.interface.cli.common import DEVICE_HELP
from gpuflow.train.suggest import PRESET_VOCAB_SIZES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="training steps under the profiler and the transfer ledger: trace, timeline, metrics",
        description="Run a preset's training steps on its data path, after --warmup untimed "
        "ones, under torch's profiler and gpuflow's transfer ledger. Writes trace.json (open "
        "it in Perfetto), timeline.png and profile.json into --out, and prints the bytes each "
        "way, host syncs and cudaMalloc calls per step, the transfer metrics, the "
        "ledger-vs-profiler cross-check and where the step's device time goes. On a CPU the "
        "step is timed by the host clock and there is no timeline.",
    )
    p.add_argument("--preset", help=f"{', '.join(PRESET_VOCAB_SIZES)} (default tiny)")
    p.add_argument("--config", metavar="FILE.toml", help="a TOML config applied on the preset")
    p.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting"
    )
    p.add_argument("--steps", type=int, default=10, help="steps to profile (default 10)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument(
        "--out",
        help="output folder: new, empty or an earlier profile's (default: runs/profile-<preset>)",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device
    from gpuflow.interface.profile import OUTPUT_FILES, profile_training
    from gpuflow.interface.profile_folder import check_output_folder
    from gpuflow.train.config import resolve_config
    from gpuflow.train.runfolder import RUNS_DIR

    device = Device.resolve(args.device)
    config = resolve_config(args.preset, args.config, args.set or ())
    out = Path(args.out) if args.out else RUNS_DIR / f"profile-{config.preset}"
    check_output_folder(out)  # a refused folder is said before the run is announced
    out_console.print(f"profiling {args.steps} steps of {config.preset} on {device} into {out}")
    result = profile_training(config, out, device, steps=args.steps, warmup=args.warmup)
    _print_profile(result)
    written = [f"{out}/{name}" for name in OUTPUT_FILES if (out / name).exists()]
    if result["note"]:
        out_console.print(f"note: {result['note']}")
    out_console.print(f"wrote {', '.join(written)}")
    return 0


def _print_profile(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    m, steps = result["metrics"], result["steps"]

    def fraction(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    title = f"{result['preset']}, {result['data_path']}: {steps} profiled steps (medians)"
    figures = table("metric", "value", title=title)
    rows = [
        (f"step time ({result['step_clock']})", f"{m['step_ms']:.2f} ms"),
        ("host->device per step", f"{m['h2d_bytes_per_batch']:,.0f} B"),
        ("device->host per step", f"{m['d2h_bytes_per_batch']:,.0f} B"),
        ("host syncs per step", f"{m['syncs_per_batch']:g}"),
        ("cudaMalloc per step", f"{m['device_allocs_per_batch']:g}"),
        ("link utilisation", fraction(m["link_utilisation"])),
        ("transfer overhead", fraction(m["transfer_overhead"])),
        (
            "memory efficiency",
            "-" if m["memory_efficiency"] is None else f"{m['memory_efficiency']:.2f}",
        ),
        ("overlap efficiency", fraction(m["overlap_efficiency"])),
    ]
    for row in rows:
        figures.add_row(*row)
    out_console.print(figures)
    check = table("copies", "ledger", "profiler", "agree", title="cross-check")
    for row in result["crosscheck"]:
        check.add_row(
            row["kind"],
            f"{row['ledger_copies']} / {row['ledger_bytes']:,} B",
            f"{row['profiler_copies']} / {row['profiler_bytes']:,} B",
            ("yes" if row["agrees"] else "[bold red]no[/]")
            if row["compared"]
            else "(not compared)",
        )
    out_console.print(check)
    kernels = result.get("kernels")
    if kernels and kernels["groups"]:
        where = table(
            "group", "µs per step", "share", "kernels per step", "TFLOP/s",
            title=f"device time by kernel group, {kernels['step_us']:.0f} µs per step",
        )  # fmt: skip
        for g in kernels["groups"]:
            rate = g["tflop_per_s"]
            where.add_row(
                g["group"], f"{g['us_per_step']:.1f}", f"{g['share']:.1%}",
                f"{g['kernels_per_step']:g}", "-" if rate is None else f"{rate:.0f}",
            )  # fmt: skip
        out_console.print(where)
