"""What each ``gpuflow`` command does, given its parsed arguments (``gpuflow.interface.cli``
parses them). Each returns the exit status; bad input raises ``GpuflowError``. Heavy imports
(torch) happen inside the commands, so that ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
from typing import TYPE_CHECKING, Any

from gpuflow.common.errors import GpuflowError
from gpuflow.common.oserrors import describe_os_error

if TYPE_CHECKING:  # torch-heavy: imported inside the commands
    from pathlib import Path

    from gpuflow.device.accelerator import Device
    from gpuflow.train.config import RunConfig
    from gpuflow.train.distributed import Ranks

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a process stopped by Ctrl-C

# ---- info -----------------------------------------------------------------------------------


def _gather_info(device_spec: str) -> dict[str, Any]:
    import platform

    import torch

    from gpuflow.device.accelerator import Device, allocator_settings, available_devices
    from gpuflow.device.linkprobe import PROBE_BYTES, probe_link
    from gpuflow.device.peers import peer_report
    from gpuflow.transfer.diskread import choose_io

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
        "data_io": dataclasses.asdict(choose_io("auto", device)),  # what data.io=auto takes
        "link_probe": {
            "device": str(device),
            "bytes": PROBE_BYTES if link else None,
            "gb_per_s": link,
            "note": None if link else "skipped: the cpu has no host-device link to measure",
        },
        "peers": peer_report(device),
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
    io = info["data_io"]
    out_console.print(f"data.io auto takes {io['path']}: {io['reason']}", markup=False)
    probe = info["link_probe"]
    if not probe["gb_per_s"]:
        out_console.print(f"link probe: {probe['note']}")
    else:
        rates = table(
            "copy",
            "GB/s",
            title=f"link probe on {probe['device']}, {probe['bytes'] >> 20} MiB per copy, "
            "median of 5",
        )
        for name, rate in probe["gb_per_s"].items():
            label = "d2d (read + write)" if name == "d2d" else name.replace("_", " ")
            rates.add_row(label, f"{rate:.1f}")
        out_console.print(rates)
    peers = info["peers"]
    if not peers["devices"]:
        out_console.print(f"peers: {peers['note']}")
        return
    names = peers["devices"]
    access = table("from \\ to", *names, title="peer access")
    mib = peers["bytes"] >> 20
    copies = table("from \\ to", *names, title=f"d2d GB/s, {mib} MiB, median of {peers['repeats']}")
    for name, can, rates in zip(names, peers["access"], peers["gb_per_s"], strict=True):
        access.add_row(name, *("yes" if c else "no" for c in can))
        copies.add_row(name, *(f"{r:.1f}" for r in rates))
    out_console.print(access)
    out_console.print(copies)
    out_console.print("d2d: within a GPU, bytes read + written; between GPUs, bytes moved once")


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

    config = PrepareConfig(
        data=tuple(args.data or ()),
        out=args.out or "",
        vocab_size=args.vocab_size,
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
    summary = prepare(config)
    out_console.print(summary.describe())
    from gpuflow.train.suggest import train_command  # (train/config.py would load torch)

    out_console.print(f"train on it: {train_command(summary.vocab_size, summary.out_dir)}")
    return 0


def unescape(text: str) -> str:
    """``\\n``, ``\\r``, ``\\t`` and ``\\\\`` in a command-line argument, as a shell user
    means them; everything else as it is (non-ASCII text included)."""
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}
    return re.sub(r"\\([nrt\\])", lambda m: escapes[m[1]], text)


# ---- train ----------------------------------------------------------------------------------


def _run_config(args: argparse.Namespace) -> tuple[Path | None, RunConfig]:
    """The config ``gpuflow train ARGS`` runs, and the run folder when resuming (a new run's
    folder is named later, by rank 0). Reads files only: every rank can call it."""
    from gpuflow.train.config import apply_overrides, resolve_config
    from gpuflow.train.run import RUNS_DIR, check_name, latest_run_dir, resumed_config

    if args.resume:
        run_dir = RUNS_DIR / check_name(args.name) if args.name else latest_run_dir()
        return run_dir, resumed_config(
            run_dir, args.set or (), args.steps, args.preset, args.config
        )
    config = resolve_config(args.preset, args.config, args.set or ())
    if args.steps is not None:
        config = apply_overrides(config, {"train": {"steps": args.steps}}, "--steps")
    return None, config


def _use_allocator(config: RunConfig, device_name: str, argv: list[str]) -> None:
    """On CUDA, start again with the run's allocator if it is not the one in effect."""
    from gpuflow.device.accelerator import Device
    from gpuflow.device.allocator import use_allocator

    if Device.resolve(device_name).type == "cuda":
        use_allocator(config.train.allocator, argv)


def cmd_train(args: argparse.Namespace) -> int:
    from gpuflow.train import distributed

    resolved = _run_config(args)
    _use_allocator(resolved[1], args.device, args.argv)
    # Under torchrun this process is one rank of a data-parallel job, on its own device.
    ranks = distributed.Ranks.from_env()
    device = distributed.rank_device(ranks, args.device)
    distributed.start(ranks, device)
    try:
        code = _train(args, resolved, ranks, device)
    except BaseException as exc:
        distributed.abort()  # nothing in flight is waited for: another rank may be gone
        if distributed.lost_a_rank(exc):
            raise distributed.rank_lost(exc) from exc
        raise
    distributed.stop()
    return code


def _train(
    args: argparse.Namespace, resolved: tuple[Path | None, RunConfig], ranks: Ranks,
    device: Device,
) -> int:  # fmt: skip
    from gpuflow.common.console import out_console
    from gpuflow.interface.report import write_report
    from gpuflow.train.distributed import broadcast_from_main
    from gpuflow.train.run import new_run_dir
    from gpuflow.train.trainer import Trainer

    chosen = None
    if args.data:  # a raw corpus: prepared once per host (its first rank), then its folder
        resolved = (resolved[0], _with_prepared_data(args, resolved[1], ranks))
    if ranks.is_main:  # rank 0 names the run folder, for every rank, with its config
        run_dir, config = resolved
        if run_dir is None:
            run_dir = new_run_dir(args.name or config.preset, explicit=args.name is not None)
        chosen = (run_dir, config)
    run_dir, config = broadcast_from_main(chosen, ranks)  # type: ignore[misc]

    if ranks.is_main:
        job = f", {ranks.world_size} ranks" if ranks.distributed else ""
        out_console.print(f"run folder {run_dir}, preset {config.preset}, device {device}{job}")
    trainer = Trainer(config, run_dir, device, ranks=ranks)
    result = trainer.run(resume=args.resume, show_bus=args.bus)
    if not ranks.is_main:
        return EXIT_INTERRUPTED if result.interrupted else 0
    try:
        report = write_report(config, result)
    except OSError as exc:  # the training is done and saved: say so, and what is missing
        raise GpuflowError(
            f"{result.run_dir} trained to step {result.last_step} and its checkpoints are saved "
            f"(gpuflow sample --run {result.run_dir} works), but its report could not be "
            f"written: {describe_os_error(exc)}"
        ) from None
    rate = f"{report['tokens_per_s']:,.0f} tokens/s" if report["tokens_per_s"] else "-"
    if ranks.distributed and report["tokens_per_s"]:
        rate += f" ({report['tokens_per_s_per_rank']:,.0f} per rank)"
    reduced = report["collective_bytes_per_step_per_rank"]
    if reduced:  # NCCL's traffic, which the transfer ledger cannot see
        rate += f", {reduced / 2**20:,.1f} MiB per step per rank to NCCL"
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
    if not result.interrupted:
        out_console.print(f"sample from it: gpuflow sample --run {shlex.quote(str(run_dir))}")
    return EXIT_INTERRUPTED if result.interrupted else 0


def _with_prepared_data(args: argparse.Namespace, config: RunConfig, ranks: Ranks) -> RunConfig:
    from gpuflow.data.prepare import prepared_for_training
    from gpuflow.train.config import apply_overrides
    from gpuflow.train.distributed import each_host_first

    if args.resume:
        raise GpuflowError("--resume trains on the run's own data; leave --data out")
    if config.data.dir:
        raise GpuflowError(
            f"--data and data.dir ({config.data.dir}) both name the training data; keep one"
        )
    separator = unescape(args.separator) if args.separator is not None else None
    with each_host_first(ranks):
        folder = prepared_for_training(
            tuple(args.data), config.model.vocab_size, separator, args.text_field
        )
    return apply_overrides(config, {"data": {"dir": str(folder)}}, "--data")


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
    from gpuflow.common.console import err_console

    print(sample(args.run, config, Device.resolve(args.device), say=err_console.print))
    return 0


# ---- bench ----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from gpuflow.bench.common import check_results_folder, write_result
    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device

    check_results_folder(args.out)  # before the bench's time, not after it

    if args.bench == "train":  # before CUDA starts: its allocator is chosen then
        from gpuflow.train.config import resolve_config

        _use_allocator(resolve_config(args.preset, None, args.set or ()), args.device, args.argv)
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
        path = write_result(args.bench, device, results, args.out, preset=args.preset)
        plot = plot_soak(results, path.with_suffix(".png"))
        out_console.print(f"results: {path} and {plot}")
        return 0 if results["flat"] else 1
    elif args.bench == "io":
        from gpuflow.bench.io import IoBenchConfig, print_io_table, run_io_bench

        io = IoBenchConfig(mib=args.mib, repeats=args.repeats, data=args.data or "")
        if args.out:  # the generated shards go beside the results
            io = dataclasses.replace(io, scratch=args.out)
        results = run_io_bench(device, io)
        print_io_table(results)
    elif args.bench == "prepare":
        from gpuflow.bench.prepare import (
            PrepareBenchConfig,
            print_prepare_table,
            run_prepare_bench,
        )

        bench = PrepareBenchConfig(
            mib=args.mib,
            data=tuple(args.data or ()),
            separator=unescape(args.separator) if args.separator else None,
            vocab_size=args.vocab_size,
            workers=args.workers,
        )
        results = run_prepare_bench(bench)
        print_prepare_table(results)
    elif args.bench == "scale":
        from gpuflow.bench.scale import ScaleConfig, print_scale_table, run_scale_bench

        scale = ScaleConfig(
            preset=args.preset, steps=args.steps, nproc=args.nproc, overrides=tuple(args.set or ())
        )
        results = run_scale_bench(device, scale)
        print_scale_table(results)
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
    # The run's preset names the file; transfer's is its size, io's the shards it read.
    if args.bench == "transfer":
        preset = "quick" if args.quick else "full"
    elif args.bench == "io":
        preset = os.path.basename(os.path.normpath(args.data)) if args.data else "generated"
    elif args.bench == "prepare":
        first = os.path.basename(args.data[0].rstrip("/")).split(".")[0] if args.data else ""
        preset = first or f"{args.mib}mib"
    else:
        preset = args.preset
    gpus = results.get("nproc", 1) if args.bench == "scale" else 1
    path = write_result(args.bench, device, results, args.out, preset=preset, gpus=gpus)
    out_console.print(f"results: {path}")
    return 0


# ---- parser ---------------------------------------------------------------------------------
