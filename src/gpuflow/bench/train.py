"""``gpuflow bench train``: every data path on the same model and data, in one process.

For each data path (``gpuflow.train.datapath.DataPath``) a fresh model from the same seed
trains ``warmup`` untimed steps, ``timed`` steps between two device synchronisations (tokens/s and
MFU), then ``LEDGER_PAIRS`` pairs of logging intervals, one under the transfer ledger and
one not, in alternating order: the first counted interval gives bytes each way, host syncs
and cudaMalloc calls per step (its scalar readback included), and the median of the pairs'
time ratios what counting costs a step, side by side so that the host's drift over the row
does not enter it. The same step on a
pre-placed synthetic batch (the batch drawn once and reused: no data path at all), eager and
captured, shows each path's data-path overhead as a percentage.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpuflow.bench.baselines  # noqa: F401  (registers the naive and standard modes' rows)
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.common.console import err_console
from gpuflow.data.resident.sources import FixedBatch
from gpuflow.device.accelerator import Device
from gpuflow.device.allocator import allocator_in
from gpuflow.train.config import RunConfig, apply_overrides, resolve_config
from gpuflow.train.datapath import DataPath, open_batches, resolve_data_path
from gpuflow.train.step import StepOptions
from gpuflow.train.trainer import Trainer, run_steps

MODES = tuple(str(path) for path in DataPath.runnable())
LEDGER_PAIRS = 3  # logging intervals under the ledger, each beside one without it


@dataclass(frozen=True)
class TrainBenchConfig:
    preset: str | None = "seed-d384"  # None: the config file's
    modes: tuple[str, ...] = MODES
    warmup: int = 10
    timed: int = 50
    overrides: tuple[str, ...] = ()
    config_file: str | None = None  # a TOML config applied on the preset, as train's --config


def measure_data_path(
    config: RunConfig,
    device: Device,
    path: DataPath,
    run_dir: Path,
    warmup: int,
    timed: int,
    synthetic: bool = False,
    options: StepOptions | None = None,
) -> dict[str, Any]:
    """One row: ``path`` (on a pre-placed batch if ``synthetic``), built with ``options``."""
    counted = config.train.log_interval
    total = warmup + timed + 2 * LEDGER_PAIRS * counted
    config = apply_overrides(config, {"train": {"data_path": str(path)}}, "bench train")
    trainer = Trainer(config, run_dir, device, options)
    trainer.build(resume=False, say=lambda note: None)  # notes on the run, not on measuring it
    source = None
    if synthetic:  # one batch, drawn before the clock starts and reused by every step
        with open_batches(path, trainer.setup.plan, device, 0, total) as batches:
            source = FixedBatch.first_of(batches)
    with trainer.open_step(0, total, source) as train_step:
        run_steps(train_step, 0, warmup)
        device.synchronize()
        started = time.perf_counter()
        run_steps(train_step, warmup, warmup + timed)
        device.synchronize()
        seconds = time.perf_counter() - started
        first, intervals = warmup + timed, {True: [], False: []}
        ledger = None
        for pair in range(LEDGER_PAIRS):
            for counting in (True, False) if pair % 2 == 0 else (False, True):
                started = time.perf_counter()
                if counting:
                    with TransferLedger(device) as interval_ledger:
                        run_steps(train_step, first, first + counted)
                    ledger = ledger or interval_ledger
                else:
                    run_steps(train_step, first, first + counted)
                device.synchronize()  # (outside the ledger: the bench's wait, not the step's)
                intervals[counting].append(time.perf_counter() - started)  # opening it too
                first += counted
        train_step.scalars.drain(total)
    ratios = [a / b for a, b in zip(intervals[True], intervals[False], strict=True)]
    rate = timed * trainer.tokens_per_step / seconds
    return {
        "mode": str(path) + (" (synthetic batch)" if synthetic else ""),
        "tokens_per_s": rate,
        "step_ms": seconds * 1e3 / timed,
        "mfu": trainer.mfu(rate),
        **ledger.summary().totals.per_step(counted),
        # What counting costs the step: intervals under the ledger against those beside them.
        "ledger_step_ms": statistics.median(intervals[True]) * 1e3 / counted,
        "unledgered_step_ms": statistics.median(intervals[False]) * 1e3 / counted,
        "ledger_pair_ratios": ratios,
        "ledger_cost": statistics.median(ratios) - 1,
        # What the allocator holds from the device after the row (None off CUDA).
        "reserved_bytes": device.memory_sample()["device_reserved_bytes"],
        "batching": trainer.setup.batching,
    }


def run_train_bench(device: Device, bench: TrainBenchConfig) -> dict[str, Any]:
    given = resolve_config(bench.preset, bench.config_file, list(bench.overrides))
    interval = given.train.log_interval
    # the schedule's length: every step in warmup+cosine
    steps = bench.warmup + bench.timed + max(100, 2 * LEDGER_PAIRS * interval)
    config = apply_overrides(given, {"train": {"steps": steps}}, "bench train")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        plan = [(mode, False) for mode in bench.modes]
        plan += [("resident", True)]
        if device.type == "cuda":
            plan += [("resident-graph", True)]
        for mode, synthetic in plan:
            path, why = resolve_data_path(mode, device, config.train.allocator)
            if why:
                skipped[mode] = why
                continue
            label = f"{mode}{' on a synthetic batch' if synthetic else ''}"
            with err_console.status(f"measuring {label}..."):
                rows.append(
                    measure_data_path(
                        config,
                        device,
                        path,
                        Path(scratch) / f"{mode}-{synthetic}",
                        bench.warmup,
                        bench.timed,
                        synthetic,
                    )
                )
    batching = rows[0].pop("batching") if rows else None
    for row in rows[1:]:
        row.pop("batching")
    by_mode = {row["mode"]: row for row in rows}
    standard, naive = by_mode.get("standard"), by_mode.get("naive")
    for row in rows:
        if standard:
            row["vs_standard"] = row["tokens_per_s"] / standard["tokens_per_s"]
        if naive:
            row["vs_naive"] = row["tokens_per_s"] / naive["tokens_per_s"]
        base = "resident-graph" if row["mode"].startswith("resident-graph") else "resident"
        reference = by_mode.get(f"{base} (synthetic batch)")
        if reference and "synthetic" not in row["mode"]:
            row["data_path_overhead"] = reference["tokens_per_s"] / row["tokens_per_s"] - 1
    return {
        "preset": config.preset,
        "config": {
            "warmup": bench.warmup,
            "timed": bench.timed,
            "overrides": bench.overrides,
            "config_file": bench.config_file,
        },
        "model": dataclasses.asdict(config.model),
        "batch_size": batching.micro_batch if batching else config.train.batch_size,
        "accumulation": batching.accumulation if batching else 1,
        "tokens_per_step": batching.tokens_per_step if batching else None,
        "seq_len": config.model.max_len,
        "allocator": allocator_in(os.environ),
        "rows": rows,
        "skipped": skipped,
    }


def _accumulated(result: dict[str, Any]) -> str:
    k = result.get("accumulation", 1)
    return f", {k} micro-batches a step" if k > 1 else ""


def print_train_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    # Two tables of a few columns each, rows in the same order: one table of ten does not
    # fit 80 columns with its figures whole.
    speed = table(
        "data path",
        "tokens/s",
        "MFU",
        "vs naive",
        "vs standard",
        "data-path overhead",
        title=(
            f"{result['preset']} (B {result['batch_size']}, T {result['seq_len']}"
            f"{_accumulated(result)}): "
            "each data path, same model and data"
        ),
    )
    bus = table(
        "data path",
        "h2d bytes",
        "d2h bytes",
        "host syncs",
        "cudaMalloc calls",
        "ledger cost",
        title="bus traffic per step, from the transfer ledger (and what counting costs)",
    )
    for row in result["rows"]:
        mfu = row.get("mfu")
        overhead = row.get("data_path_overhead")
        vs = row.get("vs_standard")
        vs_naive = row.get("vs_naive")
        speed.add_row(
            row["mode"],
            f"{row['tokens_per_s']:,.0f}",
            f"{mfu:.1%}" if mfu is not None else "-",
            f"{vs_naive:.1f}x" if vs_naive is not None else "-",
            f"{vs:.2f}x" if vs is not None else "-",
            f"{overhead:+.1%}" if overhead is not None else "",
        )
        bus.add_row(
            row["mode"],
            f"{row['h2d_bytes_per_step']:,.0f}",
            f"{row['d2h_bytes_per_step']:,.1f}",
            f"{row['syncs_per_step']:g}",
            f"{row['device_allocs_per_step']:g}",
            f"{row['ledger_cost']:+.0%}",
        )
    out_console.print(speed)
    out_console.print(bus)
    for mode, why in result["skipped"].items():
        out_console.print(f"{mode}: {why}")
