"""The parser of every command, and what ``main`` makes of what a command raises."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gpuflow.common.errors import GpuflowError, InterruptedAndSaid
from gpuflow.interface.cli import bench, export, info, prepare, profile, sample, train
from gpuflow.interface.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED

COMMANDS = (info, prepare, train, bench, profile, sample, export)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    from gpuflow import __version__

    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="GPU-resident PyTorch training that moves across the host-device bus "
        "only what must cross.",
    )
    parser.add_argument("--version", action="version", version=f"gpuflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start again with (allocator)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GpuflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # a fault of the machine that no command turned into its own line
        from gpuflow.common.oserrors import describe_os_error

        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        torch = sys.modules.get("torch")  # loaded by any command that could run out
        if torch is None or not isinstance(exc, torch.OutOfMemoryError):
            raise
        from gpuflow.device.accelerator import out_of_memory_figures

        print(
            f"error: out of device memory ({out_of_memory_figures(exc)}); lower the batch "
            "size, sequence length or model size",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        if not isinstance(exc, InterruptedAndSaid):
            print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
