"""Shared by the step A/B probes: one resident-graph measurement of a variant in a round,
printed and appended to a JSON file as soon as it lands (a later variant may run past the
device's time limit)."""

import json
from pathlib import Path
from typing import Any

from gpuflow.bench.train import measure_data_path
from gpuflow.device.accelerator import Device
from gpuflow.train.config import RunConfig
from gpuflow.train.datapath import DataPath
from gpuflow.train.step import StepOptions


def measure_row(
    config: RunConfig,
    device: Device,
    label: str,
    round_: int,
    scratch: str,
    rows: list[dict[str, Any]],
    out: str | None,
    meta: dict[str, Any],
    options: StepOptions | None = None,
) -> dict[str, Any]:
    run_dir = Path(scratch) / f"{label}{round_}"
    row = measure_data_path(
        config, device, DataPath.RESIDENT_GRAPH, run_dir, 10, 50, options=options
    )
    row.update(variant=label, round=round_)
    print(
        f"{label:10s} round {round_}: {row['tokens_per_s']:,.0f} tok/s "
        f"{row['step_ms']:.3f} ms/step MFU {row['mfu']:.1%}",
        flush=True,
    )
    rows.append(row)
    if out:
        Path(out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return row
