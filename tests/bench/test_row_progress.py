"""A bench row's progress line, read from the run's metrics as the trainer writes them, and
the runner that calls for it while a child process runs."""

from __future__ import annotations

import sys

from gpuflow.bench import scale
from gpuflow.bench.row_progress import TAIL_BYTES, progress_line
from gpuflow.train.runfolder import METRICS_FILE, MetricsLog


def _train_record(step: int, elapsed_s: float) -> dict:
    return {"step": step, "loss": 5.0, "elapsed_s": elapsed_s, "tokens_per_s": 1000.0}


def test_no_metrics_or_only_an_evaluation_is_starting(tmp_path):
    assert progress_line(tmp_path, 300) == "starting"
    log = MetricsLog(tmp_path)
    log.write({"step": 0, "val_loss": 9.1})
    assert progress_line(tmp_path, 300) == "starting"


def test_the_last_step_and_the_time_left_at_the_pace_of_the_last_two_records(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"step": 0, "val_loss": 9.1})
    log.write(_train_record(2, 100.0))  # compiling took most of that
    assert progress_line(tmp_path, 10) == "step 2/10"
    log.write(_train_record(4, 104.0))  # 2 s a step from here
    assert progress_line(tmp_path, 10) == "step 4/10, about 12 s left"
    log.write(_train_record(6, 244.0))  # 70 s a step: 294 steps are nearly 6 hours
    assert progress_line(tmp_path, 300) == "step 6/300, about 5.7 h left"
    log.write(_train_record(300, 250.0))
    assert progress_line(tmp_path, 300) == "step 300/300, about 0 s left"


def test_a_torn_last_line_and_a_record_cut_by_the_tail_are_left_out(tmp_path):
    log = MetricsLog(tmp_path)
    filler = {"step": 1, "loss": 5.0, "elapsed_s": 1.0, "pad": "x" * 900}
    for _ in range(2 * TAIL_BYTES // 1000):
        log.write(filler)  # the tail starts part way through one of these
    log.write(_train_record(40, 50.0))
    log.write(_train_record(50, 60.0))
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 60, "loss": 4.9, "elaps')  # still being written
    assert progress_line(tmp_path, 100) == "step 50/100, about 50 s left"


def test_run_child_asks_for_progress_while_the_child_runs(tmp_path):
    calls = []
    command = [sys.executable, "-c", "import time; time.sleep(2.5)"]
    outcome = scale.run_child(
        command, tmp_path, scale.child_env(), tmp_path / "job", lambda: calls.append(1)
    )
    assert outcome.returncode == 0
    assert 1 <= len(calls) <= 3  # once a PROGRESS_S while it slept
