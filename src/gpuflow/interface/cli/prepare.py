"""``gpuflow prepare``: tokenize a corpus into train/val token shards."""

from __future__ import annotations

import argparse
import signal

from gpuflow.common.signals import handling
from gpuflow.interface.cli.common import add_corpus_arguments, unescape


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus into train/val token shards",
        description="Tokenize a corpus into a token folder that gpuflow train reads: train "
        "and val shards of token ids, the tokenizer.json they were made with, and meta.json. "
        "A byte-level BPE is trained on an even sample of the corpus (--vocab-size), unless "
        "--tokenizer gives one. Memory stays bounded whatever the corpus's size, every core "
        "encodes, and a prepare that was stopped continues where it was when started again. "
        "It ends with the gpuflow train command that fits the vocabulary.",
    )
    add_corpus_arguments(p, data_help=(
        ".txt/.md/.jsonl/.parquet files (maybe .gz/.bz2/.xz/.zst), folders, globs, datasets "
        "saved with save_to_disk, or - for standard input (default: the built-in corpus of "
        "Python's own documentation); other files named or globbed ('src/**/*.py') are read "
        "as text, except .json, .csv and .tsv"
    ))  # fmt: skip
    p.add_argument("--out", help="output folder (default: data/<corpus>-v<vocab>)")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="BPE vocabulary size to train (default: 16000; not with --append, which keeps the "
        "folder's tokenizer)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE|DIR|NAME",
        help="reuse a tokenizer instead of training one: a tokenizer.json, a folder holding "
        "one, or a Hugging Face hub name such as gpt2 (fetched; needs a network)",
    )
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=200,
        metavar="MB",
        help="MB of text, drawn evenly from the corpus, that the tokenizer is trained on "
        "(default: 200; inf or more than the corpus: all of it; from standard input: the "
        "first that many MB; less, and said, where "
        "its words would take the trainer past 1.5 GiB)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of documents held out for validation, by a hash of each (default: 0.05)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="tokens per train shard file, at least (default: 100000000); a val shard closes "
        "with each train shard, where an interrupted run resumes, so val shards are smaller",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes that encode (default 0: one a core, as many as about 3 GiB holds; the "
        "output is the same bytes whatever the number)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add the documents of --data to the token folder --out, with its tokenizer (the "
        "folder changes at once, when they are all encoded; an input it holds is refused)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild an output folder that prepare wrote before (the old one stays until the "
        "new one is complete; a folder holding anything else is never touched)",
    )
    p.set_defaults(func=run)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from gpuflow.common.console import err_console, out_console
    from gpuflow.common.errors import GpuflowError
    from gpuflow.data.prepare.pipeline import DEFAULT_VOCAB, PrepareConfig, prepare

    for flag, value in (("--out", args.out), ("--tokenizer", args.tokenizer)):
        if value is not None and not value.strip():  # an unset shell variable: not the default
            raise GpuflowError(f"{flag} is empty; name a path, or leave {flag} out")
    if args.append and args.vocab_size is not None:
        raise GpuflowError(
            "--append encodes with the folder's own tokenizer, whose vocabulary is set; leave "
            "--vocab-size out"
        )
    config = PrepareConfig(
        data=tuple(args.data or ()),
        out=args.out or "",
        vocab_size=DEFAULT_VOCAB if args.vocab_size is None else args.vocab_size,
        tokenizer=args.tokenizer or "",
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        force=args.force,
        append=args.append,
        separator=unescape(args.separator) if args.separator is not None else None,
        text_field=args.text_field,
        sample_mb=args.tokenizer_sample_mb,
        workers=args.workers,
    )
    # SIGTERM (kill, timeout, a scheduler) stops it as Ctrl-C does: its workers shut down, its
    # finished shards kept and said so, rather than the process ending without a word.
    with handling([signal.SIGTERM], _interrupt):
        summary = prepare(config)
    out_console.print(summary.describe())
    # (train/config.py would load torch)
    from gpuflow.train.suggest import (
        TINY_ON_CPU,
        gpu_present,
        short_split_note,
        suggested_preset,
        train_command,
    )

    gpu = gpu_present()
    out_console.print(f"train on it: {train_command(summary.vocab_size, summary.out_dir, gpu)}")
    if not summary.appended:  # (an appending run counts only what it added)
        preset = suggested_preset(summary.vocab_size, gpu)
        note = short_split_note(preset, summary.train_tokens, summary.val_tokens)
        if note:
            err_console.print(note)
    if not gpu:
        out_console.print(f"(no GPU here: the preset suits a CPU; {TINY_ON_CPU})")
    return 0
