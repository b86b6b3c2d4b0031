"""``gpuflow export``: a run's checkpoint as a folder another library loads."""

from __future__ import annotations

import argparse

from gpuflow.interface.cli.common import add_checkpoint_argument


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a transformers GPT-2 folder",
        description="Write a run's checkpoint as a folder that transformers loads as a GPT-2 "
        "causal LM (AutoModelForCausalLM.from_pretrained(DIR)): config.json, "
        "model.safetensors (GPT-2's biases, which gpuflow's model lacks, as zeros), "
        "tokenizer.json and tokenizer_config.json. Its context length is the run's "
        "model.max_len: generate() fails past it, where gpuflow sample slides its window. "
        "transformers' decode keeps <|endoftext|> unless skip_special_tokens=True; gpuflow "
        "sample begins the prompt with it and drops it from the text (docs/cli.md).",
    )
    p.add_argument("--run", required=True, metavar="DIR", help="a run folder, e.g. runs/tiny")
    p.add_argument(
        "--format",
        default="hf",
        choices=("hf",),
        help="hf (the only one, and the default): a transformers GPT-2 folder",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder")
    add_checkpoint_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuflow.common.console import err_console, out_console
    from gpuflow.interface.export import export_hf

    checkpoint = export_hf(args.run, args.out, args.checkpoint, say=err_console.print)
    out_console.print(f"exported {checkpoint} to {args.out}")
    out_console.print(
        f"load it: transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})"
    )
    return 0
