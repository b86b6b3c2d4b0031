"""What several commands share: exit statuses, argument groups, escapes, the allocator."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-heavy: imported inside the functions
    from gpuflow.train.config import RunConfig

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a process stopped by Ctrl-C
DEVICE_HELP = "auto (default), cpu, cuda, cuda:N, xpu, mps"


def add_corpus_arguments(p: argparse.ArgumentParser, data_help: str) -> None:
    """--data and how its files hold documents: for prepare, and train on a raw corpus."""
    p.add_argument("--data", nargs="+", metavar="PATH", help=data_help)
    p.add_argument(
        "--separator",
        metavar="TEXT",
        help="text files hold many documents, between these (\\n is a newline: '\\n\\n' "
        "splits at blank lines; '<|endoftext|>'); default: one document per file",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field or column with the text in .jsonl, .parquet and datasets (default: text)",
    )


def unescape(text: str) -> str:
    """``\\n``, ``\\r``, ``\\t`` and ``\\\\`` in a command-line argument, as a shell user
    means them; everything else as it is (non-ASCII text included)."""
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}
    return re.sub(r"\\([nrt\\])", lambda m: escapes[m[1]], text)


def use_allocator(config: RunConfig, device_name: str, argv: list[str]) -> None:
    """On CUDA, start again with the run's allocator if it is not the one in effect."""
    from gpuflow.device.accelerator import Device
    from gpuflow.device.allocator import use_allocator as restart_with

    if Device.resolve(device_name).type == "cuda":
        restart_with(config.train.allocator, argv)


def add_checkpoint_argument(p: argparse.ArgumentParser) -> None:
    """``--checkpoint``: which of a run's checkpoints a command reads."""
    p.add_argument(
        "--checkpoint",
        default="best",
        help="best (default: the lowest validation loss), latest, or a folder name such as "
        "step_000300",
    )
