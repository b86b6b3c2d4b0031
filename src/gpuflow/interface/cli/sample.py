"""``gpuflow sample``: generate text from a run's checkpoint."""

from __future__ import annotations

import argparse

from gpuflow.interface.cli.common import DEVICE_HELP, add_checkpoint_argument


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a run's best checkpoint",
        description="Generate text from a run's checkpoint (by default its best: the lowest "
        "validation loss), continuing --prompt, or starting a document without one. Tokens "
        "are drawn on the device; the model sees the last model.max_len of them, so the text "
        "may run past its context. It stops at the first <|endoftext|>, which it leaves out.",
    )
    p.add_argument(
        "--run",
        metavar="DIR",
        help="a run folder, e.g. runs/tiny (default: the run most recently active in runs/)",
    )
    add_checkpoint_argument(p)
    p.add_argument("--prompt", default="", help="text to continue (default: start a document)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=200,
        help="tokens to generate, at most 10,000 (default 200)",  # interface.sample.MAX_TOKENS
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (default 0.8)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=50,
        help="sample among the k likeliest tokens; 0 for all (default 50)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuflow.device.accelerator import Device
    from gpuflow.interface.sample import SampleConfig, sample

    config = SampleConfig(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        checkpoint=args.checkpoint,
    )
    from gpuflow.common.console import err_console

    run_dir = args.run
    if run_dir is None:  # as `train --resume` without --name takes it
        from gpuflow.train.runfolder import latest_run_dir

        run_dir = latest_run_dir()
        err_console.print(f"sampling {run_dir}, the run most recently active in runs/")
    print(sample(run_dir, config, Device.resolve(args.device), say=err_console.print))
    return 0
