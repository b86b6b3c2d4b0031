"""``gpuflow train``: pretrain a GPT into runs/<name>/, alone or as one rank under torchrun."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflow.common.errors import GpuflowError
from gpuflow.common.oserrors import describe_os_error
from gpuflow.interface.cli.common import (
    DEVICE_HELP,
    EXIT_INTERRUPTED,
    add_corpus_arguments,
    unescape,
    use_allocator,
)
from gpuflow.train.suggest import PRESET_VOCAB_SIZES

if TYPE_CHECKING:  # torch-heavy: imported inside the functions
    from pathlib import Path

    from gpuflow.device.accelerator import Device
    from gpuflow.train.config import RunConfig
    from gpuflow.train.distributed import Ranks


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain a GPT; everything lands in runs/<name>/",
        description="Pretrain a GPT; everything lands in runs/<name>/. Under torchrun "
        "(torchrun --nproc_per_node=N -m gpuflow train ...) each process is one rank of a "
        "data-parallel job, on its own GPU; rank 0 writes.",
    )
    p.add_argument(
        "--preset",
        help=f"{', '.join(PRESET_VOCAB_SIZES)} (default: the --config file's preset, else tiny; "
        "given, it is used in place of the file's)",
    )
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
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
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
    p.set_defaults(func=run)


def _run_config(args: argparse.Namespace) -> tuple[Path | None, RunConfig]:
    """The config ``gpuflow train ARGS`` runs, and the run folder when resuming (a new run's
    folder is named later, by rank 0). Reads files only: every rank can call it."""
    from gpuflow.train.config import apply_overrides, resolve_config
    from gpuflow.train.runfolder import RUNS_DIR, check_name, latest_run_dir, resumed_config

    if args.resume:
        run_dir = RUNS_DIR / check_name(args.name) if args.name is not None else latest_run_dir()
        return run_dir, resumed_config(
            run_dir, args.set or (), args.steps, args.preset, args.config
        )
    config = resolve_config(args.preset, args.config, args.set or ())
    if args.steps is not None:
        config = apply_overrides(config, {"train": {"steps": args.steps}}, "--steps")
    return None, config


def run(args: argparse.Namespace) -> int:
    from gpuflow.train import distributed
    from gpuflow.train.datapath import registered

    resolved = _run_config(args)
    if not registered(resolved[1].train.data_path):  # a baseline: the bench registers it
        import gpuflow.bench.baselines  # noqa: F401
    use_allocator(resolved[1], args.device, args.argv)
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
    from gpuflow.train.distributed import broadcast_from_main
    from gpuflow.train.report import write_report
    from gpuflow.train.runfolder import locks_kept, new_run_dir
    from gpuflow.train.trainer import Trainer

    chosen = None
    if args.data:  # a raw corpus: prepared once per host (its first rank), then its folder
        resolved = (resolved[0], _with_prepared_data(args, resolved[1], ranks))
    if ranks.is_main:  # rank 0 names the run folder, for every rank, with its config
        run_dir, config = resolved
        if run_dir is None:
            run_dir = new_run_dir(
                config.preset if args.name is None else args.name, explicit=args.name is not None
            )
        chosen = (run_dir, config)
    run_dir, config = broadcast_from_main(chosen, ranks)  # type: ignore[misc]

    with locks_kept():  # the run stays locked until its report is written too
        trainer = Trainer(config, run_dir, device, ranks=ranks)
        result = trainer.run(resume=args.resume, show_bus=args.bus)
        if not ranks.is_main:
            return EXIT_INTERRUPTED if result.interrupted else 0
        try:
            report = write_report(config, result)
        except (OSError, GpuflowError) as exc:  # the training is done and saved: say so
            cause = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
            raise GpuflowError(
                f"{result.run_dir} trained to step {result.last_step} and its checkpoints are "
                f"saved (gpuflow sample --run {result.run_dir} works), but its report could not "
                f"be written: {cause}"
            ) from None
    rate = f"{report['tokens_per_s']:,.0f} tokens/s" if report["tokens_per_s"] else "-"
    if ranks.distributed and report["tokens_per_s"]:
        rate += f" ({report['tokens_per_s_per_rank']:,.0f} per rank)"
    reduced = report["collective_bytes_per_step_per_rank"]
    if reduced:  # traffic between the ranks, which the transfer ledger cannot see
        rate += f", {reduced / 2**20:,.1f} MiB per step per rank exchanged between ranks"
        if report["exchange"]:
            rate += f" ({report['exchange']})"
    mfu = f", MFU {report['mfu']:.1%}" if report["mfu"] else ""
    val = (
        f"val loss {report['final_val_loss']:.4f} at step {report['final_val_step']}"
        if report["final_val_loss"] is not None
        else "no val loss yet"
    )
    if report["final_val_bpb"] is not None:
        val += f", val bpb {report['final_val_bpb']:.4f}"
    train_loss = report["final_train_loss"]
    out_console.print(
        f"{'stopped' if result.interrupted else 'finished'} at step {result.last_step}: "
        f"train loss {'-' if train_loss is None else f'{train_loss:.4f}'}, {val}, "
        f"{rate}{mfu}; see {run_dir}/report.json and {run_dir}/training.png"
    )
    if not result.interrupted:
        out_console.print(f"sample from it: gpuflow sample --run {shlex.quote(str(run_dir))}")
    return EXIT_INTERRUPTED if result.interrupted else 0


def _names_the_runs_data(
    args: argparse.Namespace, config: RunConfig, separator: str | None
) -> bool:  # fmt: skip
    """Whether ``--data`` (with its settings) is what the resumed run's data was prepared
    from, unchanged: the folder it would be prepared into is the run's."""
    from gpuflow.data.prepare.for_training import cache_folder

    if not config.data.dir or "-" in args.data:
        return False
    same = cache_folder(config.model.vocab_size, tuple(args.data), separator, args.text_field)
    return Path(config.data.dir).resolve() == same.resolve()


def _with_prepared_data(args: argparse.Namespace, config: RunConfig, ranks: Ranks) -> RunConfig:
    """``config`` training on ``--data``'s token folder, which ``prepared_for_training`` writes
    into data/cache/ on first use."""
    from gpuflow.data.prepare.for_training import prepared_for_training
    from gpuflow.train.config import apply_overrides
    from gpuflow.train.distributed import each_host_first

    separator = unescape(args.separator) if args.separator is not None else None
    if args.resume:
        if _names_the_runs_data(args, config, separator):
            return config  # the command that started the run, again: its own data
        from gpuflow.train.runfolder import RUNS_DIR

        run = RUNS_DIR / (args.name or "NAME")
        raise GpuflowError(
            f"--data names other text than the run was trained on ({config.data.dir}), or its "
            "files changed since; --resume trains on the run's own data: leave --data out (to "
            "go on over other text, encode it with the run's tokenizer: gpuflow prepare --data "
            f"PATH --tokenizer {run}/tokenizer.json --out DIR, then resume with --set "
            "data.dir=DIR)"
        )
    if config.data.dir:
        raise GpuflowError(
            f"--data and data.dir ({config.data.dir}) both name the training data; keep one"
        )
    with each_host_first(ranks):
        folder = prepared_for_training(
            config.model.vocab_size, tuple(args.data), separator, args.text_field
        )
    return apply_overrides(config, {"data": {"dir": str(folder)}}, "--data")
