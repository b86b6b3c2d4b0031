"""The ``gpuflow`` command: info, prepare, train, sample, bench, profile.

Every command turns bad input into one line on stderr (``error: ...``) and exit status 2;
heavy imports (torch) happen inside commands so that ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from gpuflow.common.errors import GpuflowError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


# ---- info -----------------------------------------------------------------------------------


def _gather_info(device_spec: str) -> dict[str, Any]:
    import platform

    import torch

    from gpuflow.device.accelerator import Device, allocator_settings, available_devices
    from gpuflow.device.linkprobe import PROBE_BYTES, probe_link

    device = Device.resolve(device_spec)
    link = probe_link(device)
    return {
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        },
        "devices": [d.describe() for d in available_devices()],
        "selected": str(device),
        "allocator": allocator_settings(),
        "link_probe": {
            "device": str(device),
            "bytes": PROBE_BYTES if link else None,
            "gb_per_s": link,
            "note": None if link else "skipped: the cpu has no host-device link to measure",
        },
    }


def _print_info(info: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    sw = info["software"]
    out_console.print(
        f"[bold]gpuflow info[/]  python {sw['python']}  torch {sw['torch']}  "
        f"cuda {sw['cuda'] or '-'}  cudnn {sw['cudnn'] or '-'}"
    )
    devices = table("device", "name", "memory", "details", title="devices")
    for d in info["devices"]:
        memory = d.get("total_memory_bytes")
        details = ", ".join(
            f"{k.replace('_', ' ')} {v}"
            for k, v in d.items()
            if k in ("compute_capability", "multiprocessors", "peak_bf16_tflops", "threads") and v
        )
        devices.add_row(
            d["device"], d["name"], f"{memory / 2**30:.1f} GiB" if memory else "-", details
        )
    out_console.print(devices)
    allocator = info["allocator"]
    out_console.print(
        "allocator: "
        + (", ".join(f"{k}={v}" for k, v in allocator.items()) if allocator else "torch defaults")
    )
    probe = info["link_probe"]
    if not probe["gb_per_s"]:
        out_console.print(f"link probe: {probe['note']}")
        return
    rates = table(
        "copy",
        "GB/s",
        title=f"link probe on {probe['device']}, {probe['bytes'] >> 20} MiB per copy, median of 5",
    )
    for name, rate in probe["gb_per_s"].items():
        label = "d2d (read + write)" if name == "d2d" else name.replace("_", " ")
        rates.add_row(label, f"{rate:.1f}")
    out_console.print(rates)


def cmd_info(args: argparse.Namespace) -> int:
    info = _gather_info(args.device)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


# ---- prepare --------------------------------------------------------------------------------


def cmd_prepare(args: argparse.Namespace) -> int:
    from gpuflow.common.console import out_console
    from gpuflow.data.prepare import PrepareConfig, prepare
    from gpuflow.train.config import train_command

    config = PrepareConfig(
        data=tuple(args.data or ()),
        out=args.out or "",
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer or "",
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        force=args.force,
    )
    summary = prepare(config)
    out_console.print(summary.describe())
    out_console.print(f"train on it: {train_command(summary.vocab_size, summary.out_dir)}")
    return 0


# ---- train ----------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device
    from gpuflow.interface.report import write_report
    from gpuflow.train.config import apply_overrides, resolve_config
    from gpuflow.train.run import RUNS_DIR, check_name, latest_run_dir, new_run_dir, resumed_config
    from gpuflow.train.trainer import Trainer

    device = Device.resolve(args.device)
    if args.resume:
        run_dir = RUNS_DIR / check_name(args.name) if args.name else latest_run_dir()
        config = resumed_config(run_dir, args.set or (), args.steps, args.preset, args.config)
    else:
        config = resolve_config(args.preset, args.config, args.set or ())
        if args.steps is not None:
            config = apply_overrides(config, {"train": {"steps": args.steps}}, "--steps")
        run_dir = new_run_dir(args.name or config.preset, explicit=args.name is not None)

    out_console.print(f"run folder {run_dir}, preset {config.preset}, device {device}")
    result = Trainer(config, run_dir, device).run(resume=args.resume, show_bus=args.bus)
    report = write_report(config, result)
    rate = f"{report['tokens_per_s']:,.0f} tokens/s" if report["tokens_per_s"] else "-"
    mfu = f", MFU {report['mfu']:.1%}" if report["mfu"] else ""
    val = (
        f"val loss {report['final_val_loss']:.4f} at step {report['final_val_step']}"
        if report["final_val_loss"] is not None
        else "no val loss yet"
    )
    train_loss = report["final_train_loss"]
    out_console.print(
        f"{'stopped' if result.interrupted else 'finished'} at step {result.last_step}: "
        f"train loss {'-' if train_loss is None else f'{train_loss:.4f}'}, {val}, "
        f"{rate}{mfu}; see {run_dir}/report.json and {run_dir}/training.png"
    )
    return EXIT_INTERRUPTED if result.interrupted else 0


# ---- profile --------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device
    from gpuflow.interface.profile import OUTPUT_FILES, profile_training
    from gpuflow.train.config import apply_overrides, parse_set, resolve_config
    from gpuflow.train.run import RUNS_DIR

    device = Device.resolve(args.device)
    config = resolve_config(args.preset, args.config)
    for assignment in args.set or ():
        config = apply_overrides(config, parse_set(assignment), f"--set {assignment}")
    out = Path(args.out) if args.out else RUNS_DIR / f"profile-{config.preset}"
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


# ---- sample ---------------------------------------------------------------------------------


def cmd_sample(args: argparse.Namespace) -> int:
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
    print(sample(args.run, config, Device.resolve(args.device)))
    return 0


# ---- bench ----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from gpuflow.bench.common import write_result
    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device

    device = Device.resolve(args.device)
    out_console.print(f"bench {args.bench} on {device} ({device.name()})")
    if args.bench == "transfer":
        from gpuflow.bench.transfer import (
            TransferBenchConfig,
            print_transfer_tables,
            run_transfer_bench,
        )

        config = TransferBenchConfig.quick() if args.quick else TransferBenchConfig()
        results = run_transfer_bench(device, config)
        print_transfer_tables(results)
    elif args.bench == "checkpoint":
        from gpuflow.bench.checkpoint import (
            CheckpointBenchConfig,
            print_checkpoint_table,
            run_checkpoint_bench,
        )

        if args.rounds < 1 or args.window < 2:
            raise GpuflowError(
                f"--rounds must be >= 1 and --window >= 2, got {args.rounds}, {args.window}"
            )
        bench = CheckpointBenchConfig(
            preset=args.preset,
            window=args.window,
            rounds=args.rounds,
            overrides=tuple(args.set or ()),
        )
        results = run_checkpoint_bench(device, bench)
        print_checkpoint_table(results)
    elif args.bench == "soak":
        from gpuflow.bench.soak import SoakConfig, plot_soak, print_soak_table, run_soak

        if args.steps < 1:
            raise GpuflowError(f"--steps must be >= 1, got {args.steps}")
        soak = SoakConfig(preset=args.preset, steps=args.steps, overrides=tuple(args.set or ()))
        results = run_soak(device, soak)
        print_soak_table(results)
        path = write_result(args.bench, device, results, args.out)
        plot = plot_soak(results, path.with_suffix(".png"))
        out_console.print(f"results: {path} and {plot}")
        return 0 if results["flat"] else 1
    else:
        from gpuflow.bench.train import MODES, TrainBenchConfig, print_train_table, run_train_bench

        modes = tuple(m.strip() for m in args.modes.split(",")) if args.modes else MODES
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise GpuflowError(
                f"unknown data path {unknown[0]!r} in --modes; choose from {', '.join(MODES)}"
            )
        if args.steps < 1:
            raise GpuflowError(f"--steps must be >= 1, got {args.steps}")
        bench = TrainBenchConfig(
            preset=args.preset,
            modes=modes,
            timed=args.steps,
            warmup=args.warmup,
            overrides=tuple(args.set or ()),
        )
        results = run_train_bench(device, bench)
        print_train_table(results)
    path = write_result(args.bench, device, results, args.out)
    out_console.print(f"results: {path}")
    return 0


# ---- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="GPU-resident PyTorch training that moves across the host-device bus "
        "only what must cross.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="accelerators, software versions, allocator, link speeds")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    p.add_argument("--device", default="auto", help="device to probe (default: auto)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token shards")
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help=".txt/.md/.jsonl files or folders of them (default: the built-in corpus "
        "of Python's own documentation)",
    )
    p.add_argument("--out", help="output folder (default: data/<corpus>-v<vocab>)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=16000,
        help="BPE vocabulary size to train (default: 16000)",
    )
    p.add_argument(
        "--tokenizer", metavar="FILE", help="reuse this tokenizer.json instead of training one"
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of documents held out for validation (default: 0.05)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="tokens per shard file (default: 100000000)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild an output folder that prepare wrote before (the old one stays until the "
        "new one is complete; a folder holding anything else is never touched)",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="pretrain a GPT; everything lands in runs/<name>/")
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
        "pinned/pageable/pooled copies, packing, payload codecs, DeviceLoader vs DataLoader",
        overrides=False,
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p = bench_parser(
        "train",
        "each data path (naive, standard, streamed, resident, resident-graph) on one model: "
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
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GpuflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
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
