"""``gpuflow bench images``'s options: the image loop's sizes, or ``--quick``'s own."""

from __future__ import annotations

import argparse
from typing import Any

from gpuflow.common.errors import GpuflowError

_IMAGES_DEFAULTS = {"batch_size": 512, "steps": 100, "rounds": 5, "widths": "32,64,128,256"}


def images_arguments(p: argparse.ArgumentParser) -> None:
    d = _IMAGES_DEFAULTS
    p.add_argument("--quick", action="store_true", help="tiny images: a smoke run in seconds")
    p.add_argument(
        "--batch-size", type=int, default=d["batch_size"], help="images per step (default 512)"
    )
    p.add_argument(
        "--steps", type=int, default=d["steps"], help="timed steps per round (default 100)"
    )
    p.add_argument(
        "--rounds", type=int, default=d["rounds"], help="rounds of every feed (default 5)"
    )
    p.add_argument(
        "--widths", default=d["widths"], metavar="A,B,C,D",
        help="the net's channels per stage (default 32,64,128,256; narrower nets train faster "
        "and so ask more of the feed)",
    )  # fmt: skip


def run_images(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.images import print_images_table, run_images_bench

    results = run_images_bench(device, images_config(args))
    print_images_table(results)
    return results


def images_config(args: argparse.Namespace) -> Any:
    from gpuflow.bench.images import ImagesBenchConfig

    if args.quick:
        given = [
            f"--{name.replace('_', '-')}" for name, default in _IMAGES_DEFAULTS.items()
            if getattr(args, name) != default
        ]  # fmt: skip
        if given:
            raise GpuflowError(
                f"--quick runs its own small sizes, so {' and '.join(given)} would be ignored; "
                "drop them, or drop --quick"
            )
        return ImagesBenchConfig.quick()
    return ImagesBenchConfig(
        batch_size=args.batch_size, steps=args.steps, rounds=args.rounds,
        widths=_widths(args.widths),
    )  # fmt: skip


def _widths(text: str) -> tuple[int, int, int, int]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if len(widths) != 4 or min(widths) < 1:
        raise GpuflowError(
            f"--widths takes four positive channel counts, like 32,64,128,256; got {text!r}"
        )
    return widths


def images_name(args: argparse.Namespace) -> str:
    if args.quick:
        return "quick"
    widths = _widths(args.widths)
    return "cifar" if widths == (32, 64, 128, 256) else f"cifar-w{widths[0]}"
