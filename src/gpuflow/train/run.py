"""The run folder `runs/<name>/`: config, metrics, report, plot, tokenizer, checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from gpuflow.atomic import write_text_atomic
from gpuflow.errors import GpuflowError
from gpuflow.train.config import RunConfig, apply_overrides, load_toml, preset, to_toml

RUNS_DIR = Path("runs")
CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
PLOT_FILE = "training.png"
TOKENIZER_FILE = "tokenizer.json"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise GpuflowError(
            f"run name {name!r} must start with a letter or digit and use only letters, digits, "
            "'.', '_' and '-'"
        )
    return name


def new_run_dir(base_name: str, explicit: bool) -> Path:
    """``runs/<base_name>``, or the first free ``runs/<base_name>-N`` when the name was not
    given explicitly; an explicit name that is taken is an error (work is never overwritten)."""
    check_name(base_name)
    path = RUNS_DIR / base_name
    if not path.exists():
        return path
    if explicit:
        raise GpuflowError(
            f"{path} already exists; pass --resume to continue it, or another --name"
        )
    n = 2
    while (RUNS_DIR / f"{base_name}-{n}").exists():
        n += 1
    return RUNS_DIR / f"{base_name}-{n}"


def latest_run_dir() -> Path:
    """The run whose metrics or config changed last, for ``--resume`` without ``--name``."""
    runs = [
        p for p in (RUNS_DIR.iterdir() if RUNS_DIR.is_dir() else []) if (p / CONFIG_FILE).is_file()
    ]
    if not runs:
        raise GpuflowError(f"there is no run in {RUNS_DIR}/ to resume; start one without --resume")

    def last_active(run: Path) -> float:
        return max(
            (run / f).stat().st_mtime for f in (CONFIG_FILE, METRICS_FILE) if (run / f).exists()
        )

    return max(runs, key=last_active)


def open_run(path: Path | str) -> tuple[Path, RunConfig]:
    """An existing run folder and its config; refuses folders that are not runs."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise GpuflowError(f"run folder {path} does not exist; runs live in {RUNS_DIR}/<name>")
    if not config_path.is_file():
        raise GpuflowError(
            f"{path} is not a gpuflow run (it has no {CONFIG_FILE}); pass a folder made by "
            "`gpuflow train`, such as runs/tiny"
        )
    values = load_toml(config_path)
    name = values.get("preset", "tiny")
    config = apply_overrides(preset(name), values, str(config_path))
    return path, config


def write_config(run_dir: Path, config: RunConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, to_toml(config))


def copy_tokenizer(run_dir: Path, tokenizer_path: Path | None) -> None:
    if tokenizer_path is not None and not (run_dir / TOKENIZER_FILE).exists():
        shutil.copyfile(tokenizer_path, run_dir / TOKENIZER_FILE)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop records past ``last_step``: steps a resumed run will train again."""
    kept = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    write_text_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))


class MetricsLog:
    """Appends one JSON record per line and flushes it, so a crash loses at most one line."""

    def __init__(self, run_dir: Path) -> None:
        self._file = open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
