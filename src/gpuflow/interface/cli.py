"""The ``gpuflow`` command: info, prepare, train, sample, bench, profile.

Every command turns bad input into one line on stderr (``error: ...``) and exit status 2;
heavy imports (torch) happen inside commands so that ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gpuflow.common.errors import GpuflowError
from gpuflow.interface.commands import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    cmd_bench,
    cmd_info,
    cmd_prepare,
    cmd_profile,
    cmd_sample,
    cmd_train,
)


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


def build_parser() -> argparse.ArgumentParser:
    from gpuflow.train.datapath import DataPath  # light: no torch

    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="GPU-resident PyTorch training that moves across the host-device bus "
        "only what must cross.",
    )
    from gpuflow import __version__

    parser.add_argument("--version", action="version", version=f"gpuflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="accelerators, software versions, allocator, link speeds")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    p.add_argument("--device", default="auto", help="device to probe (default: auto)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token shards")
    add_corpus_arguments(p, data_help=(
        ".txt/.md/.jsonl/.parquet files (maybe .gz/.bz2/.xz/.zst), folders, globs, datasets "
        "saved with save_to_disk, or - for standard input (default: the built-in corpus of "
        "Python's own documentation)"
    ))  # fmt: skip
    p.add_argument("--out", help="output folder (default: data/<corpus>-v<vocab>)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=16000,
        help="BPE vocabulary size to train (default: 16000)",
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
        "(default: 200; from standard input: the first that many MB)",
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
        help="tokens per shard file, at least (default: 100000000)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes that encode (default 0: every core; the output is the same bytes "
        "whatever the number)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add the documents of --data to the token folder --out, with its tokenizer",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild an output folder that prepare wrote before (the old one stays until the "
        "new one is complete; a folder holding anything else is never touched)",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "train",
        help="pretrain a GPT; everything lands in runs/<name>/",
        description="Pretrain a GPT; everything lands in runs/<name>/. Under torchrun "
        "(torchrun --nproc_per_node=N -m gpuflow train ...) each process is one rank of a "
        "data-parallel job, on its own GPU; rank 0 writes.",
    )
    p.add_argument("--preset", help="tiny (default), seed-d512, seed-d384, seed-d256, gpt2-124m")
    p.add_argument("--config", metavar="FILE.toml", help="a TOML config applied on the preset")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set train.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--name",
        help="run folder name under runs/ (default: the preset's name, with -2, -3... if taken)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue run --name (default: the most recently active run) from its latest "
        "intact checkpoint; --preset/--config must give its saved config, --set changes it",
    )
    p.add_argument("--steps", type=int, help="total steps to train (overrides train.steps)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, xpu, mps")
    p.add_argument(
        "--bus",
        action="store_true",
        help="always show the bus figures (bytes each way, host syncs, cudaMalloc per step); "
        "by default they show once one is not zero",
    )
    add_corpus_arguments(p, data_help=(
        "train on this raw corpus (the files prepare takes): it is prepared once, with a BPE of "
        "model.vocab_size, into data/cache/, and reused while the files are unchanged"
    ))  # fmt: skip
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "bench", help="measure a path beside its baseline; JSON to runs/bench (or --out)"
    )
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def bench_parser(name: str, help: str, overrides: bool = True) -> argparse.ArgumentParser:
        """A ``bench NAME`` parser with the options every benchmark has."""
        parser = bench.add_parser(name, help=help)
        if overrides:
            parser.add_argument(
                "--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting"
            )
        parser.add_argument(
            "--device", default="auto", help="auto (default), cpu, cuda, cuda:N, xpu, mps"
        )
        parser.add_argument("--out", help="results folder (default: runs/bench)")
        parser.set_defaults(func=cmd_bench)
        return parser

    p = bench_parser(
        "transfer",
        "pinned/pageable/pooled copies, packing, payload codecs, DeviceLoader vs the PyTorch "
        "idioms at 8 KiB-64 MiB, an image loop",
        overrides=False,
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p = bench_parser(
        "train",
        f"each data path ({', '.join(DataPath.runnable())}) on one model: "
        "tokens/s, MFU, bytes, syncs and cudaMalloc per step",
    )
    p.add_argument("--preset", default="seed-d384", help="the model and batch (default seed-d384)")
    p.add_argument("--modes", help="comma-separated data paths (default: all of them)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per mode (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p = bench_parser(
        "checkpoint",
        "how long saving a checkpoint stops training: the usual blocking save vs gpuflow's "
        "async one, and how long the write takes",
    )
    p.add_argument("--preset", default="gpt2-124m", help="the model (default gpt2-124m)")
    p.add_argument("--window", type=int, default=10, help="steps per timed window (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (default 3)")
    p = bench_parser(
        "soak",
        "a long training run sampling host, pinned and device memory and cudaMalloc calls; "
        "exit 1 if any grows after warm-up",
    )
    p.add_argument("--preset", default="tiny", help="the run to soak (default tiny)")
    p.add_argument("--steps", type=int, default=10_000, help="steps to train (default 10000)")
    p = bench_parser(
        "io",
        "token shards into device memory through kvikio, gpuflow's pinned reads and memmap + "
        ".to(), cold and warm, beside the link's peak",
        overrides=False,
    )
    p.add_argument(
        "--data", help="a prepared token folder whose train shards are read (default: random "
        "shards written beside the results and removed after)",
    )  # fmt: skip
    p.add_argument("--mib", type=int, default=2048, help="MiB of generated shards (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed reads per path (default 3)")
    p = bench_parser(
        "prepare",
        "gpuflow prepare beside the script a user would write with the same tokenizers "
        "library, on one corpus: wall time, MB/s, tokens/s, peak memory",
        overrides=False,
    )
    p.add_argument("--mib", type=int, default=100, help="MiB of generated corpus (default 100)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="text files or folders to use instead")
    p.add_argument("--separator", metavar="TEXT", help="with --data: the documents' separator")
    p.add_argument("--vocab-size", type=int, default=16000, help="BPE vocabulary (default 16000)")
    p.add_argument("--workers", type=int, default=0, help="gpuflow's (default 0: every core)")
    p = bench_parser(
        "scale",
        "the same training run as a plain process, under torchrun with 1 process and with N "
        "(one per GPU), each in a child process: tokens/s, speedup, scaling efficiency",
    )
    p.add_argument("--preset", default="seed-d384", help="the run (default seed-d384)")
    p.add_argument(
        "--steps",
        type=int,
        default=300,
        help="steps per row (default 300: tens of logging intervals for a steady median)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        help="processes of the last row (default: every visible GPU; 2 on the cpu)",
    )

    p = sub.add_parser(
        "profile",
        help="training steps under the profiler and the transfer ledger: trace, timeline, metrics",
    )
    p.add_argument("--preset", help="tiny (default), seed-d512, seed-d384, seed-d256, gpt2-124m")
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
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, xpu, mps")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("sample", help="generate text from a run's best checkpoint")
    p.add_argument("--run", required=True, metavar="DIR", help="a run folder, e.g. runs/tiny")
    p.add_argument(
        "--checkpoint",
        default="best",
        help="best (default: the lowest validation loss), latest, or a folder name such as "
        "step_000300",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: start a document)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to generate (default 200)")
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
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, xpu, mps")
    p.set_defaults(func=cmd_sample)
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
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
