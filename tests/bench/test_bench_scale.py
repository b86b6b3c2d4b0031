"""``gpuflow bench scale`` on the cpu: plain, torchrun 1 and torchrun 2 in child processes,
their figures, the errors of bad input and of a failing child, and no leftovers: neither
its temporary runs folder nor a process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gpuflow.bench import scale
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.interface.cli.main import main
from tests.helpers import (
    FAST,
    gpuflow_cli,
    interrupt_as_children_start,
    processes_in,
    stopped,
)


def _bench_args(prepared: Path, out: Path, *extra: str) -> list[str]:
    sets = [*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=1000"]
    args = ["bench", "scale", "--preset", "tiny", "--device", "cpu", "--steps", "8"]
    return [*args, "--out", str(out), *(a for s in sets for a in ("--set", s)), *extra]


def _scratch_left(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("gpuflow-scale-*"))


def test_scale_runs_plain_torchrun_1_and_2_and_reports_their_scaling(prepared, workdir):
    tmp = workdir / "tmp"
    tmp.mkdir()
    result = gpuflow_cli(
        *_bench_args(prepared, workdir / "results", "--nproc", "2"),
        cwd=workdir,
        env={"TMPDIR": str(tmp)},
    )
    assert result.returncode == 0, result.stderr
    for progress in ("[1/3] plain", "[2/3] torchrun 1", "[3/3] torchrun 2"):
        assert progress in result.stderr
    assert "torchrun 1 vs plain:" in result.stdout and "efficiency" in result.stdout
    (path,) = (workdir / "results").glob("*-scale-tiny-cpu.json")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "scale" and record["machine"]["type"] == "cpu"
    rows = record["rows"]
    assert [r["row"] for r in rows] == ["plain", "torchrun 1", "torchrun 2"]
    assert [r["world_size"] for r in rows] == [1, 1, 2]
    assert [r["processes"] for r in rows] == [1, 1, 2]
    assert "torch.distributed.run" not in rows[0]["command"]
    assert "--nproc_per_node=2" in rows[2]["command"]
    plain = rows[0]["tokens_per_s"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["steps_done"] == 8
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / plain)
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["world_size"])
        assert row["tokens_per_s_per_rank"] == pytest.approx(
            row["tokens_per_s"] / row["world_size"]
        )
        step_s = row["tokens_per_step"] / row["tokens_per_s"]
        assert row["step_ms"] == pytest.approx(1e3 * step_s)
        # the step less one rank's share of it at the plain row's rate
        own_s = row["tokens_per_step"] / row["world_size"] / plain
        assert row["job_cost_ms_per_step"] == pytest.approx(1e3 * (step_s - own_s))
    assert rows[0]["job_cost_ms_per_step"] == pytest.approx(0.0, abs=1e-9)
    # The job of 2 trains both ranks' batches; only the torchrun rows all-reduce.
    assert rows[2]["tokens_per_step"] == 2 * rows[0]["tokens_per_step"]
    assert rows[0]["collective_bytes_per_step_per_rank"] is None
    assert rows[1]["collective_bytes_per_step_per_rank"] > 0
    assert record["torchrun_1_vs_plain"] == pytest.approx(rows[1]["tokens_per_s"] / plain - 1)
    assert record["env_defaults"] == {"NCCL_NVLS_ENABLE": "0"}
    # Nothing left behind: the scratch folder (torchrun's logs in it) is gone, and no runs/
    # appeared in the cwd.
    assert _scratch_left(tmp) == [] and list(tmp.glob("torchelastic_*")) == []
    assert not (workdir / "runs").exists()


def test_bad_nproc_and_too_few_steps_are_one_line_errors(prepared, workdir, capsys):
    assert main(_bench_args(prepared, workdir, "--nproc", "0")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --nproc must be >= 1, got 0"]
    assert main([*_bench_args(prepared, workdir), "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logging intervals" in err[0] and "--steps 8" in err[0]


def test_more_processes_than_visible_gpus_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert scale.job_size(Device("cuda", 0), None) == 2
    assert scale.job_size(Device("cuda", 0), 1) == 1
    with pytest.raises(GpuflowError, match="--nproc 3 needs 3 GPUs but 2 are visible"):
        scale.job_size(Device("cuda", 0), 3)
    with pytest.raises(GpuflowError, match="CUDA_VISIBLE_DEVICES"):
        scale.job_size(Device("cuda", 1), None)
    assert scale.job_size(Device("cpu"), None) == 2
    # One process in all: no third row.
    assert [r.label for r in scale.plan_rows(1)] == ["plain", "torchrun 1"]


def test_a_failing_child_names_its_row_and_its_error(prepared, workdir):
    tmp = workdir / "tmp"
    tmp.mkdir()
    missing = workdir / "no-tokens"  # the bench leaves a data.dir for the children to check
    args = _bench_args(prepared, workdir / "results", "--set", f"data.dir={missing}")
    result = gpuflow_cli(*args, cwd=workdir, env={"TMPDIR": str(tmp)})
    assert result.returncode == 2
    assert "[1/3] plain" in result.stderr and "[2/3]" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("error: bench scale: row 'plain' failed (exit status 2): ")
    assert f"token folder {missing} does not exist" in errors[0]  # the child's own words
    assert _scratch_left(tmp) == []
    assert not (workdir / "results").exists()  # no result from a failed bench


def test_a_failed_torchrun_row_is_named_with_the_cause_behind_torchruns_summary():
    stderr = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        "error: out of device memory on cuda:1 (12.0 GiB free); lower train.batch_size",
        "E1124 05:00:00 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 2)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "============================================================",
        "gpuflow FAILED",
        "  exitcode  : 2 (pid: 12)",
        "============================================================",
    ])  # fmt: skip
    row = scale.plan_rows(2)[2]
    assert row.label == "torchrun 2" and "--nproc_per_node=2" in row.command([])
    assert scale.failure_line(row, scale.ChildOutcome(1, 1.0, stderr)) == (
        "bench scale: row 'torchrun 2' failed (exit status 1): out of device memory on cuda:1 "
        "(12.0 GiB free); lower train.batch_size"
    )


def test_last_words_pick_the_cause_out_of_torchruns_summary():
    torchrun_tail = "\n".join([
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: CUDA error: out of memory",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "============================================================",
        "gpuflow FAILED",
        "  exitcode  : 1 (pid: 12)",
        "============================================================",
    ])  # fmt: skip
    assert scale.last_words(torchrun_tail) == "RuntimeError: CUDA error: out of memory"
    assert scale.last_words("[rank0]: error: bad thing\nmore\n") == "bad thing"
    assert scale.last_words("a\nb\nc\nd\n") == "b | c | d"
    assert scale.last_words("") == "(nothing on stderr)"


def test_an_interrupt_stops_torchrun_and_its_workers_that_ignore_sigterm(tmp_path, monkeypatch):
    """Ctrl-C while a torchrun job runs: SIGTERM to its group, and after the grace, SIGKILL
    to every process below it, its workers (in sessions of their own) included."""
    monkeypatch.setattr(scale, "STOP_GRACE_S", 1.0)
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(stubborn)]  # fmt: skip

    def interrupt_once_workers_run() -> None:
        deadline = time.monotonic() + 60
        while len(processes_in(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # torchrun and its 2 workers
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does to this process

    threading.Thread(target=interrupt_once_workers_run, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        scale.run_child(command, tmp_path, scale.child_env(), tmp_path / "job")
    assert time.monotonic() - started < 30  # the grace, not torchrun's own 30 s
    deadline = time.monotonic() + 5
    while processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_in(tmp_path) == []


def test_an_interrupt_as_the_child_starts_stops_it(tmp_path, monkeypatch):
    children = interrupt_as_children_start(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        scale.run_child(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            tmp_path,
            scale.child_env(),
            tmp_path / "job",
        )
    assert len(children) == 1 and stopped(children)
