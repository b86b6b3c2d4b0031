"""``gpuflow bench NAME``: a path beside its baseline, JSON to runs/bench (or --out).

Each bench is one entry of ``BENCHES``: its help, its own arguments, how it measures and
prints (heavy imports inside), and what names its result file. A new bench is its module in
``gpuflow.bench`` and one entry here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.interface.cli.bench_images import (
    images_arguments,
    images_config,
    images_name,
    run_images,
)
from gpuflow.interface.cli.common import DEVICE_HELP, unescape, use_allocator


@dataclass(frozen=True)
class Bench:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    # (args, device) -> results, after printing its tables
    measure: Callable[[argparse.Namespace, Any], dict[str, Any]]
    # what names the result file (YYYY-MM-DD-<bench>-<name>-<device>.json)
    name: Callable[[argparse.Namespace], str] = lambda args: args.preset
    overrides: bool = True  # takes --set
    # (args, device) -> None, raising for arguments the bench refuses, before anything is said
    check: Callable[[argparse.Namespace, Any], None] = lambda args, device: None


# ---- transfer -----------------------------------------------------------------------------------


def _transfer_arguments(p: argparse.ArgumentParser) -> None:
    from gpuflow.bench.transfer_tables import SECTIONS

    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p.add_argument(
        "--sections",
        help=f"comma-separated sections to measure (default all: {', '.join(SECTIONS)}); "
        "the result file's name then holds them, before the device",
    )


def _transfer_sections(args: argparse.Namespace) -> tuple[str, ...]:
    from gpuflow.bench.transfer_tables import SECTIONS

    if not args.sections:
        return SECTIONS
    asked = {name.strip() for name in args.sections.split(",") if name.strip()}
    unknown = sorted(asked - set(SECTIONS))
    if unknown or not asked:
        raise GpuflowError(
            f"unknown --sections {', '.join(unknown) or repr(args.sections)}; "
            f"choose from {', '.join(SECTIONS)}"
        )
    return tuple(name for name in SECTIONS if name in asked)  # in the bench's order, once


def _transfer_name(args: argparse.Namespace) -> str:
    """``full`` or ``quick``, then the sections when not all of them ran."""
    from gpuflow.bench.transfer_tables import SECTIONS

    name = "quick" if args.quick else "full"
    sections = _transfer_sections(args)
    if sections == SECTIONS:
        return name
    return "-".join([name, *(s.replace("_", "") for s in sections)])


def _transfer(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.transfer import TransferBenchConfig, run_transfer_bench
    from gpuflow.bench.transfer_tables import print_transfer_tables

    results = run_transfer_bench(
        device,
        TransferBenchConfig.quick() if args.quick else TransferBenchConfig(),
        _transfer_sections(args),
    )
    print_transfer_tables(results)
    if device.type == "cpu":
        from gpuflow.common.console import out_console

        out_console.print(CPU_TRANSFER_NOTE)
    return results


# The "device" of a CPU run is host memory: its copies say nothing of a GPU's link.
CPU_TRANSFER_NOTE = (
    "note: on the cpu every copy is within host memory, so these figures (and the targets "
    "met or missed) do not describe a GPU link; run on a machine with a GPU to measure one"
)


# ---- train --------------------------------------------------------------------------------------


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", help="the model and batch (default seed-d384, or the --config file's)"
    )
    p.add_argument("--config", metavar="FILE.toml", help="a TOML config applied on the preset")
    p.add_argument("--modes", help="comma-separated data paths (default: all of them)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per mode (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")


def _train(args: argparse.Namespace, device: Any) -> dict[str, Any]:
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
        preset=_train_preset(args), modes=modes, timed=args.steps, warmup=args.warmup,
        overrides=tuple(args.set or ()), config_file=args.config,
    )  # fmt: skip
    results = run_train_bench(device, bench)
    print_train_table(results)
    return results


def _train_preset(args: argparse.Namespace) -> str | None:
    """The preset bench train starts from: --preset, else the --config file's (None), else
    seed-d384."""
    return args.preset or (None if args.config else "seed-d384")


def _train_config(args: argparse.Namespace) -> Any:
    from gpuflow.train.config import resolve_config

    return resolve_config(_train_preset(args), args.config, args.set or ())


# ---- checkpoint ---------------------------------------------------------------------------------


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="gpt2-124m", help="the model (default gpt2-124m)")
    p.add_argument("--window", type=int, default=10, help="steps per timed window (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (default 3)")


def _checkpoint(args: argparse.Namespace, device: Any) -> dict[str, Any]:
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
        preset=args.preset, window=args.window, rounds=args.rounds,
        overrides=tuple(args.set or ()),
    )  # fmt: skip
    results = run_checkpoint_bench(device, bench)
    print_checkpoint_table(results)
    return results


# ---- soak ---------------------------------------------------------------------------------------


def _soak_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="the run to soak (default tiny)")
    p.add_argument("--steps", type=int, default=10_000, help="steps to train (default 10000)")


def _soak(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.soak import SoakConfig, print_soak_table, run_soak

    if args.steps < 1:
        raise GpuflowError(f"--steps must be >= 1, got {args.steps}")
    soak = SoakConfig(preset=args.preset, steps=args.steps, overrides=tuple(args.set or ()))
    results = run_soak(device, soak)
    print_soak_table(results)
    return results


# ---- io -----------------------------------------------------------------------------------------


def _io_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data", help="a prepared token folder whose train shards are read (default: random "
        "shards written beside the results and removed after)",
    )  # fmt: skip
    p.add_argument("--mib", type=int, default=2048, help="MiB of generated shards (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed reads per path (default 3)")


def _io(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.io import IoBenchConfig, print_io_table, run_io_bench

    io = IoBenchConfig(mib=args.mib, repeats=args.repeats, data=args.data or "")
    if args.out:  # the generated shards go beside the results
        io = dataclasses.replace(io, scratch=args.out)
    results = run_io_bench(device, io)
    print_io_table(results)
    return results


def _io_check(args: argparse.Namespace, device: Any) -> None:
    from gpuflow.bench.io import IoBenchConfig, check_io_device

    IoBenchConfig(mib=args.mib, repeats=args.repeats, data=args.data or "")
    check_io_device(device)


def _io_name(args: argparse.Namespace) -> str:
    return os.path.basename(os.path.normpath(args.data)) if args.data else "generated"


# ---- prepare ------------------------------------------------------------------------------------


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=100, help="MiB of generated corpus (default 100)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="any input prepare reads, instead")
    p.add_argument("--separator", metavar="TEXT", help="with --data: the documents' separator")
    p.add_argument("--vocab-size", type=int, default=16000, help="BPE vocabulary (default 16000)")
    p.add_argument("--workers", type=int, default=0, help="gpuflow's (default 0: as prepare)")


def _prepare(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.prepare import PrepareBenchConfig, print_prepare_table, run_prepare_bench
    from gpuflow.bench.scale import sigterm_as_interrupt

    bench = PrepareBenchConfig(
        mib=args.mib, data=tuple(args.data or ()),
        separator=unescape(args.separator) if args.separator else None,
        vocab_size=args.vocab_size, workers=args.workers,
    )  # fmt: skip
    with sigterm_as_interrupt():  # its child stopped and its scratch folder gone, as at Ctrl-C
        results = run_prepare_bench(bench)
    print_prepare_table(results)
    return results


def _prepare_name(args: argparse.Namespace) -> str:
    first = os.path.basename(args.data[0].rstrip("/")).split(".")[0] if args.data else ""
    return first or f"{args.mib}mib"


# ---- scale --------------------------------------------------------------------------------------


def _scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="seed-d384", help="the run (default seed-d384)")
    p.add_argument(
        "--steps", type=int, default=300,
        help="steps per row (default 300: tens of logging intervals for a steady median)",
    )  # fmt: skip
    p.add_argument(
        "--nproc", type=int,
        help="processes of the last row (default: every visible GPU; 2 on the cpu)",
    )  # fmt: skip


def _scale(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.scale import ScaleConfig, print_scale_table, run_scale_bench

    scale = ScaleConfig(
        preset=args.preset, steps=args.steps, nproc=args.nproc, overrides=tuple(args.set or ())
    )
    results = run_scale_bench(device, scale)
    print_scale_table(results)
    return results


# ---- reference ----------------------------------------------------------------------------------


def _reference_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nanogpt", required=True, metavar="DIR",
        help="a nanoGPT checkout (its train.py, model.py, configurator.py), run as it is",
    )  # fmt: skip
    p.add_argument(
        "--preset", help="the model and batch (default seed-d384, or the --config file's)"
    )
    p.add_argument("--config", metavar="FILE.toml", help="a TOML config applied on the preset")
    p.add_argument("--steps", type=int, help="steps both train (default: the config's)")
    p.add_argument(
        "--devices", metavar="0,1,...",
        help="GPUs for the runs, one each (nanoGPT, then gpuflow per seed): as many as runs "
        "train at once, fewer queue; default: one after another on --device",
    )  # fmt: skip
    p.add_argument(
        "--seeds", type=int, default=1,
        help="gpuflow runs, seeds train.seed, +1, ...: their spread is the noise (default 1)",
    )  # fmt: skip


def _reference_config(args: argparse.Namespace) -> Any:
    from gpuflow.bench.reference import ReferenceConfig

    try:
        devices = tuple(int(d) for d in args.devices.split(",")) if args.devices else ()
    except ValueError:
        raise GpuflowError(
            f"--devices takes GPU indices separated by commas, like 0,1; got {args.devices!r}"
        ) from None
    return ReferenceConfig(
        nanogpt=args.nanogpt, preset=_train_preset(args), config_file=args.config,
        overrides=tuple(args.set or ()), steps=args.steps, devices=devices, seeds=args.seeds,
    )  # fmt: skip


def _reference(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from gpuflow.bench.reference import run_reference_bench
    from gpuflow.bench.reference_curves import print_reference_table

    results = run_reference_bench(device, _reference_config(args))
    print_reference_table(results)
    return results


def _reference_check(args: argparse.Namespace, device: Any) -> None:
    from gpuflow.bench.reference import check_reference

    check_reference(_reference_config(args), device)


# ---- the table ----------------------------------------------------------------------------------

BENCHES: dict[str, Bench] = {
    "transfer": Bench(
        "pinned/pageable/pooled copies, packing, payload codecs, DeviceLoader vs the PyTorch "
        "idioms at 8 KiB-64 MiB and where they are worse by structure, an image loop",
        _transfer_arguments, _transfer, _transfer_name, overrides=False,
        check=lambda args, device: _transfer_sections(args) and None,
    ),
    "train": Bench(
        "each data path ({paths}) on one model: "
        "tokens/s, MFU, bytes, syncs and cudaMalloc per step",
        _train_arguments, _train, lambda args: _train_config(args).preset,
        check=lambda args, device: _train_config(args),
    ),
    "checkpoint": Bench(
        "how long saving a checkpoint stops training: the usual blocking save vs gpuflow's "
        "async one, and how long the write takes",
        _checkpoint_arguments, _checkpoint,
    ),
    "soak": Bench(
        "a long training run sampling host, pinned and device memory and cudaMalloc calls; "
        "exit 1 if any grows after warm-up",
        _soak_arguments, _soak,
    ),
    "io": Bench(
        "token shards into device memory through kvikio, gpuflow's pinned reads and memmap + "
        ".to(), cold and warm, beside the link's peak",
        _io_arguments, _io, _io_name, overrides=False, check=_io_check,
    ),
    "prepare": Bench(
        "gpuflow prepare beside the script a user would write with the same tokenizers "
        "library, on one corpus: wall time, MB/s, tokens/s, peak memory",
        _prepare_arguments, _prepare, _prepare_name, overrides=False,
    ),
    "scale": Bench(
        "the same training run as a plain process, under torchrun with 1 process and with N "
        "(one per GPU), each in a child process: tokens/s, speedup, scaling efficiency",
        _scale_arguments, _scale,
    ),
    "images": Bench(
        "an image classifier fed by DataLoader (transforms on the host, or on the device "
        "after the copy), by ResidentLoader, and on one fixed batch: images/s",
        images_arguments, run_images, images_name,
        overrides=False, check=lambda args, device: images_config(args),
    ),
    "reference": Bench(
        "the same training run in gpuflow and in nanoGPT's own train.py (--nanogpt DIR): both "
        "validation curves at equal tokens and against wall time, tokens/s, the gap",
        _reference_arguments, _reference,
        lambda args: _reference_config(args).run_config().preset, check=_reference_check,
    ),
}  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    from gpuflow.train.datapath import DataPath  # light: no torch

    p = sub.add_parser(
        "bench",
        help="measure a path beside its baseline; JSON to runs/bench (or --out)",
        description="Measure one of gpuflow's paths beside the baseline it replaces. Each "
        "bench writes its results as JSON (some a plot beside) into runs/bench/ or --out, "
        "named by date, bench, preset and device, never over earlier results. "
        "gpuflow bench BENCH --help describes each.",
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, bench in BENCHES.items():
        what = bench.help.format(paths=", ".join(DataPath.runnable()))
        parser = benches.add_parser(
            name, help=what, description=f"{what}; results to runs/bench/ (or --out) as JSON"
        )
        if bench.overrides:
            parser.add_argument(
                "--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting"
            )
        parser.add_argument("--device", default="auto", help=DEVICE_HELP)
        parser.add_argument("--out", help="results folder (default: runs/bench)")
        bench.arguments(parser)
        parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuflow.bench.results import check_results_folder, write_result
    from gpuflow.common.console import out_console
    from gpuflow.device.accelerator import Device

    check_results_folder(args.out)  # before the bench's time, not after it
    if args.bench == "train":  # before CUDA starts: its allocator is chosen then
        use_allocator(_train_config(args), args.device, args.argv)
    device = Device.resolve(args.device)
    bench = BENCHES[args.bench]
    if bench.overrides:  # --set may ask for a baseline data path, which the bench registers
        import gpuflow.bench.baselines  # noqa: F401
    bench.check(args, device)
    out_console.print(f"bench {args.bench} on {device} ({device.name()})")
    results = bench.measure(args, device)
    gpus = results.get("nproc", 1) if args.bench == "scale" else 1
    path = write_result(args.bench, device, results, args.out, preset=bench.name(args), gpus=gpus)
    if args.bench == "soak":
        from gpuflow.bench.soak import plot_soak

        plot = plot_soak(results, path.with_suffix(".png"))
        out_console.print(f"results: {path} and {plot}")
        return 0 if results["flat"] else 1
    if args.bench == "reference":
        from gpuflow.bench.reference_curves import plot_reference

        plot = plot_reference(results, path.with_suffix(".png"))
        out_console.print(f"results: {path} and {plot}")
        return 0
    out_console.print(f"results: {path}")
    return 0
