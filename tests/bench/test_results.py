"""What every bench shares: its timers, the device's short name, the results folder's check
and result files that are named by one scheme and never overwritten."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from gpuflow.bench.results import (
    RESULTS_DIR,
    check_results_folder,
    device_ms,
    device_slug,
    gb_per_s,
    wall_ms,
    write_result,
)
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

CPU = Device("cpu")


def test_wall_ms_runs_the_warmup_then_the_repeats_and_gives_their_median():
    calls: list[float] = []

    def sleep_2ms() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.002)

    ms = wall_ms(CPU, sleep_2ms, repeats=5, warmup=2)
    assert len(calls) == 7
    assert 2.0 <= ms < 200.0
    assert 2.0 <= device_ms(CPU, sleep_2ms, repeats=3, warmup=1) < 200.0  # the host clock here


def test_gb_per_s_is_bytes_over_time_and_zero_for_no_time():
    assert gb_per_s(2_000_000_000, 1000.0) == pytest.approx(2.0)
    assert gb_per_s(1 << 20, 0.0) == 0.0


@pytest.mark.parametrize(
    ("name", "count", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", 1, "h100"),
        ("NVIDIA H200", 2, "h200x2"),
        ("Tesla V100-SXM2-16GB", 1, "v100"),
    ],
)
def test_the_device_slug_is_the_model_and_the_gpu_count(name, count, slug):
    device = SimpleNamespace(type="cuda", name=lambda: name)
    assert device_slug(device, count) == slug


def test_the_cpus_slug_is_cpu():
    assert device_slug(CPU) == "cpu" and device_slug(CPU, 4) == "cpu"


def test_results_are_named_by_date_bench_preset_and_device_and_never_overwritten(tmp_path):
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    first = write_result("train", CPU, {"rows": [1, 2]}, tmp_path / "res", preset="tiny")
    second = write_result("train", CPU, {"rows": [3]}, tmp_path / "res", preset="tiny")
    assert first.name == f"{today}-train-tiny-cpu.json"
    assert second.name == f"{today}-train-tiny-cpu-2.json"
    record = json.loads(first.read_text())
    assert record["benchmark"] == "train" and record["rows"] == [1, 2]
    assert record["machine"]["torch"] == torch.__version__
    assert json.loads(second.read_text())["rows"] == [3]  # the first one kept its figures
    no_preset = write_result("transfer", CPU, {}, tmp_path / "res")
    assert no_preset.name == f"{today}-transfer-cpu.json"
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == sorted(
        [first.name, second.name, no_preset.name]
    )  # no temporary left behind


def test_the_results_folder_is_checked_before_a_bench_and_nothing_is_made(tmp_path, monkeypatch):
    check_results_folder(tmp_path / "a" / "b")  # to be made later: fine
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(GpuflowError, match=r"taken is a file, not a folder; choose another --out"):
        check_results_folder(tmp_path / "taken" / "results")
    monkeypatch.chdir(tmp_path)
    check_results_folder()  # the default, runs/bench, under a writable folder
    assert type(RESULTS_DIR)("runs") / "bench" == RESULTS_DIR


def test_a_read_only_results_folder_is_refused(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # What os.access answers for a read-only folder (as root it would say writable).
    monkeypatch.setattr(
        os, "access", lambda path, mode: real_access(path, mode) and str(path) != str(locked)
    )
    with pytest.raises(GpuflowError, match=r"locked is not writable \(a read-only file system"):
        check_results_folder(locked / "results")
    assert list(locked.iterdir()) == []


def test_results_written_at_once_each_keep_a_name_of_their_own(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        return write_result("train", CPU, {"rows": [i]}, tmp_path / "res", preset="tiny")

    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(one, range(16)))
    assert len(set(paths)) == 16
    assert sorted(json.loads(p.read_text())["rows"][0] for p in paths) == list(range(16))


def test_a_result_that_cannot_be_written_leaves_no_claim_behind(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gpuflow.bench.results.write_text_atomic", full)
    with pytest.raises(OSError):
        write_result("train", CPU, {}, tmp_path / "res", preset="tiny")
    assert list((tmp_path / "res").iterdir()) == []
