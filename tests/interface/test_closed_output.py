"""Output piped into a reader that stops reading (`gpuflow train | head -3`): the run stops as
for Ctrl-C, with a checkpoint, rather than dying mid-step with nothing saved."""

from __future__ import annotations

import json
import subprocess
import sys

from gpuflow.train import checkpoint as ckpt
from tests.helpers import FAST, child_env

WAIT_S = 120


def test_a_closed_pipe_stops_a_run_with_a_checkpoint(workdir, prepared):
    # Far more steps than the test waits for: only the closed pipe can end the run early.
    args = ["train", "--name", "piped", "--steps", "100000", "--device", "cpu"]
    for setting in (*FAST, "train.log_interval=1", f"data.dir={prepared}"):
        args += ["--set", setting]
    env = child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuflow", *args], cwd=workdir, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        first = proc.stdout.readline()
        while b"step" not in first:  # training has begun (its set-up lines come first)
            first = proc.stdout.readline()
            assert first, "the run ended before its first step"
        proc.stdout.close()  # the reader leaves, as `head` does
        assert proc.wait(timeout=WAIT_S) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)

    run_dir = workdir / "runs" / "piped"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["interrupted"] is True
    latest = ckpt.latest_checkpoint(run_dir)
    assert latest is not None and latest.name == ckpt.step_name(report["steps_done"])
    assert 0 < report["steps_done"] < 100000
