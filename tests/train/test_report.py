"""A run's report.json and training.png, built from what the run wrote."""

from __future__ import annotations

import json

import pytest

from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config, to_dict
from gpuflow.train.report import build_report, plot_run, write_report
from gpuflow.train.runfolder import PLOT_FILE, REPORT_FILE, read_metrics
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A finished 12-step run on the cpu: its config and result."""
    sets = [*FAST, f"data.dir={prepared}", "train.steps=12", "train.log_interval=2"]
    config = resolve_config("tiny", None, [*sets, "train.eval_interval=4"])
    run_dir = tmp_path_factory.mktemp("report") / "run"
    return config, Trainer(config, run_dir, Device("cpu")).run()


def test_the_report_sums_up_the_metrics_the_run_wrote(trained):
    config, result = trained
    report = build_report(config, result)
    records = read_metrics(result.run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r for r in records if "val_loss" in r]
    assert (report["steps_done"], report["steps_planned"]) == (12, 12)
    assert report["resumed_from"] is None and report["interrupted"] is False
    assert (report["first_train_loss"], report["final_train_loss"]) == (losses[0], losses[-1])
    assert report["final_val_loss"] == vals[-1]["val_loss"] and report["final_val_step"] == 12
    assert report["best_val_loss"] == min(r["val_loss"] for r in vals)
    assert report["tokens_per_step"] == 8 * 32 and report["world_size"] == 1
    assert report["tokens_per_s_per_rank"] == report["tokens_per_s"]
    assert report["config"] == to_dict(config)
    json.dumps(report)  # what report.json holds


def test_write_report_writes_the_json_and_the_picture(trained):
    config, result = trained
    report = write_report(config, result)
    assert json.loads((result.run_dir / REPORT_FILE).read_text()) == report
    assert (result.run_dir / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(result.run_dir.glob(".*.tmp"))


def test_a_run_without_train_records_has_no_picture(tmp_path):
    assert plot_run(tmp_path) is None
    assert not (tmp_path / PLOT_FILE).exists()
