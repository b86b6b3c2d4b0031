"""Crashes: `kill -9` at random moments, many of them inside checkpoint writes, and SIGINT or
SIGTERM once; after each, `--resume`. Nothing is lost, nothing temporary is left behind, and
the final weights are those of a run that was never interrupted.

The runs are real `gpuflow train` processes, started through a small wrapper around gpuflow's
own CLI. To land kills inside checkpoint writes without a hook in gpuflow, the wrapper can make
each safetensors write sleep first, which holds the write's hidden `.step_NNNNNN.tmp-<pid>`
folder open for a while; the other kills hit processes that run at their natural pace.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuflow.train import checkpoint as ckpt

from .conftest import FAST

STEPS = 80
CHECKPOINT_INTERVAL = 2
RUN_SETS = (
    *FAST,
    "train.log_interval=1",
    f"train.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "train.eval_interval=10",  # some writes also replace checkpoints/best
)
# One thread per process: the cpu kernels then give the same bits in every process (with
# more threads too, but only for equal counts), and a run leaves a core to the test's polling.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
WRITE_SLEEP_S = 0.04  # per file: a checkpoint write (two files) stays in flight >= 80 ms
# `python -c WRAPPER SECONDS train ...`: gpuflow's CLI, each safetensors write SECONDS late.
WRAPPER = """
import sys, time
from gpuflow.cli import main
from gpuflow.train import checkpoint

write, pause = checkpoint.write_safetensors, float(sys.argv[1])

def slow_write(*args):
    time.sleep(pause)
    return write(*args)

checkpoint.write_safetensors = slow_write
sys.exit(main(sys.argv[2:]))
"""
WAIT_S = 120  # for any one moment or process (2 shared cores can be slow)
POLL_S = 0.005


def _train_args(name: str, data: Path, resume: bool = False) -> list[str]:
    args = ["train", "--name", name, "--steps", str(STEPS), "--device", "cpu"]
    for setting in (*RUN_SETS, f"data.dir={data}"):
        args += ["--set", setting]
    return [*args, "--resume"] if resume else args


@contextmanager
def _launched(
    args: list[str], cwd: Path, log: Path, write_sleep: float = 0.0
) -> Iterator[subprocess.Popen]:
    """A training process started through the wrapper, its output in ``log``; killed on the
    way out if it is still running (a failed test leaves no process behind)."""
    argv = [sys.executable, "-c", WRAPPER, str(write_sleep), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=out, stderr=out)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)


def _finish(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m gpuflow ARGS`` to its end, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "gpuflow", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )


def _wait_until(ready: Callable[[subprocess.Popen], bool], proc: subprocess.Popen) -> bool:
    """Poll until ``ready(proc)``; False when the process ended first or it took too long."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if ready(proc):
            return True
        time.sleep(POLL_S)
    return False


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a line that does not parse fails the test."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            json.loads(line)
        except ValueError:
            pytest.fail(f"{path}:{number} does not parse: {line!r}")
    return [json.loads(line) for line in lines]


def _logged_steps(run_dir: Path) -> list[int]:
    """Steps with a loss record so far, read while a process may be appending (the last line
    can be half-written)."""
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def _hidden(run_dir: Path) -> list[str]:
    """Names of what a writer left: every temporary gpuflow makes starts with a dot."""
    folders = (run_dir, ckpt.checkpoint_dir(run_dir))
    return sorted(p.name for f in folders if f.is_dir() for p in f.iterdir() if p.name[0] == ".")


def _resume_step(run_dir: Path) -> int:
    latest = ckpt.latest_checkpoint(run_dir)
    return ckpt.read_record(latest)["step"] if latest else 0


# ---- the uninterrupted run everything is compared with ------------------------------------


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    losses: list[tuple[int, float]]
    val_steps: list[int]
    checkpoints: list[str]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> Reference:
    """The same command as the crash tests', run once to its end without interruption."""
    cwd = tmp_path_factory.mktemp("reference")
    result = _finish(_train_args("straight", prepared), cwd)
    assert result.returncode == 0, result.stderr
    run_dir = cwd / "runs" / "straight"
    records = _records(run_dir)
    return Reference(
        run_dir=run_dir,
        losses=[(r["step"], r["loss"]) for r in records if "loss" in r],
        val_steps=[r["step"] for r in records if "val_loss" in r],
        checkpoints=sorted(p.name for p in ckpt.checkpoint_dir(run_dir).iterdir()),
    )


def _assert_matches_reference(
    run_dir: Path, reference: Reference, story: str, baseline: bool = False
) -> None:
    """Nothing lost or repeated, nothing temporary left, the uninterrupted run's weights;
    ``baseline``: also step 0's validation record exactly once (a test of its own, see
    ``test_a_kill_before_the_first_checkpoint_logs_the_baseline_once``).

    Exact equality throughout: with one thread per process the cpu kernels give the same bits
    in every process, so a resumed run reproduces the uninterrupted one bit for bit."""
    records = _records(run_dir)
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    steps = [step for step, _ in losses]
    assert steps == list(range(1, STEPS + 1)), f"loss records lost or repeated; {story}"
    assert not _hidden(run_dir), f"temporaries left: {_hidden(run_dir)}; {story}"
    folder = ckpt.checkpoint_dir(run_dir)
    assert sorted(p.name for p in folder.iterdir()) == reference.checkpoints, story
    final = ckpt.step_name(STEPS)
    for name in (ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE):
        expected = (ckpt.checkpoint_dir(reference.run_dir) / final / name).read_bytes()
        assert (folder / final / name).read_bytes() == expected, f"{final}/{name} differs; {story}"
    assert losses == reference.losses, f"the loss curve differs; {story}"
    val_steps = [r["step"] for r in records if "val_loss" in r and (baseline or r["step"])]
    expected = [step for step in reference.val_steps if baseline or step]
    assert val_steps == expected, f"validation records at {val_steps}, not {expected}; {story}"


# ---- kill -9 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """When to kill a process: ``launch``, ``delay`` seconds after it starts (importing,
    cleaning up, restoring or training); ``step``, once it has logged step resumed + ``ahead``;
    ``write``, while its ``ahead``-th checkpoint write is in flight. Then ``delay`` more.

    Starting takes about 2 s (importing torch, building, restoring), so ``launch`` kills land
    in that or in the first steps."""

    kind: str
    ahead: int
    delay: float


def random_plan(seed: int, count: int) -> list[Kill]:
    """``count`` kills, reproducibly: 1 in 5 at a time after launch, 2 in 5 just after a step,
    2 in 5 inside a write."""
    rng = random.Random(seed)
    plan = []
    for kind in rng.choices(("launch", "step", "write"), weights=(1, 2, 2), k=count):
        if kind == "launch":
            plan.append(Kill(kind, 0, rng.uniform(1.0, 3.0)))
        elif kind == "step":
            plan.append(Kill(kind, rng.randint(1, 5), rng.uniform(0.0, 0.03)))
        else:  # well inside the write's two sleeps
            plan.append(Kill(kind, rng.randint(1, 3), rng.uniform(0.0, 0.05)))
    return plan


def _moment(kill: Kill, run_dir: Path) -> Callable[[subprocess.Popen], bool]:
    """Whether ``kill``'s moment (before its delay) has come for a process started just after
    this call."""
    start = _resume_step(run_dir)
    last = STEPS - 1  # kills stop short of the end, so that every planned kill kills
    metrics = run_dir / "metrics.jsonl"
    before = _file_id(metrics)  # a resumed run rewrites the file: then its records are its own
    launched = time.monotonic()

    def logged(step: int) -> bool:
        if _file_id(metrics) in (before, None):
            return False
        return max(_logged_steps(run_dir), default=0) >= step

    if kill.kind == "launch":
        return lambda proc: time.monotonic() - launched >= kill.delay or logged(last)
    if kill.kind == "step":
        return lambda proc: logged(min(start + kill.ahead, last))
    step = min((start // CHECKPOINT_INTERVAL + kill.ahead) * CHECKPOINT_INTERVAL, STEPS)
    tmp = f".{ckpt.step_name(step)}.tmp-"
    return lambda proc: (ckpt.checkpoint_dir(run_dir) / f"{tmp}{proc.pid}").exists()


def crash_and_resume(workdir: Path, data: Path, plan: list[Kill]) -> tuple[Path, list[str]]:
    """Kill the run at each moment of ``plan`` and start it again (with ``--resume`` once it
    has a folder), then let it finish. Returns the run folder and one line per kill."""
    run_dir = workdir / "runs" / "crash"
    story = []
    for number, kill in enumerate(plan, start=1):
        args = _train_args("crash", data, resume=run_dir.exists())
        log = workdir / f"attempt{number:02d}.log"
        start, moment = _resume_step(run_dir), _moment(kill, run_dir)
        metrics = _file_id(run_dir / "metrics.jsonl")
        write_sleep = WRITE_SLEEP_S if kill.kind == "write" else 0.0
        with _launched(args, workdir, log, write_sleep) as proc:
            came = _wait_until(moment, proc)
            time.sleep(kill.delay if kill.kind != "launch" else 0.0)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL, (
                f"kill {number} ({kill}) found the process ended (its moment came: {came}):\n"
                + log.read_text()
            )
        own = _file_id(run_dir / "metrics.jsonl") not in (metrics, None)
        reached = max(_logged_steps(run_dir), default=0) if own else start
        when = f"after step {reached:2d}" if reached > start else "before its first step"
        left = [n for n in _hidden(run_dir) if n.endswith(f"-{proc.pid}")]
        where = f"inside a write, left {', '.join(left)}" if left else "outside any write"
        story.append(f"kill {number:2d} ({kill.kind}) from step {start:2d} {when}: {where}")
    final = _finish(_train_args("crash", data, resume=run_dir.exists()), workdir)
    assert final.returncode == 0, "\n".join([*story, final.stderr])
    return run_dir, story


def _inside_writes(story: list[str]) -> int:
    return sum("inside a write" in line for line in story)


def _report(story: list[str]) -> str:
    summary = f"{len(story)} kills, {_inside_writes(story)} inside a checkpoint write"
    return "\n".join([summary, *story])


def test_kill_9_three_times_then_resume_loses_nothing(workdir, prepared, reference):
    # Kills at three different places of the run, two while a checkpoint is being written.
    plan = [Kill("write", 2, 0.02), Kill("step", 3, 0.01), Kill("write", 3, 0.03)]
    run_dir, story = crash_and_resume(workdir, prepared, plan)
    print(_report(story))
    _assert_matches_reference(run_dir, reference, _report(story))
    assert _inside_writes(story) >= 1, _report(story)


def test_a_kill_before_the_first_checkpoint_logs_the_baseline_once(workdir, prepared, reference):
    # The run has logged its step-0 validation loss; killed while its first checkpoint is being
    # written, its resume starts again from step 0.
    run_dir, story = crash_and_resume(workdir, prepared, [Kill("write", 1, 0.0)])
    _assert_matches_reference(run_dir, reference, _report(story), baseline=True)


@pytest.mark.slow
def test_kill_9_at_twenty_random_moments_then_resume_loses_nothing(workdir, prepared, reference):
    run_dir, story = crash_and_resume(workdir, prepared, random_plan(seed=20, count=20))
    print(_report(story))
    _assert_matches_reference(run_dir, reference, _report(story))
    assert _inside_writes(story) >= 4, _report(story)


# ---- SIGINT and SIGTERM ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "kill"),
    [(signal.SIGINT, Kill("write", 3, 0.02)), (signal.SIGTERM, Kill("step", 6, 0.0))],
    ids=["sigint-inside-a-write", "sigterm-between-writes"],
)
def test_a_signal_saves_where_the_run_stops_and_resume_matches(
    workdir, prepared, reference, sig, kill
):
    run_dir, log = workdir / "runs" / "stopped", workdir / "stopped.log"
    moment = _moment(kill, run_dir)
    write_sleep = WRITE_SLEEP_S if kill.kind == "write" else 0.0
    with _launched(_train_args("stopped", prepared), workdir, log, write_sleep) as proc:
        assert _wait_until(moment, proc), log.read_text()
        time.sleep(kill.delay)
        proc.send_signal(sig)
        assert proc.wait(timeout=WAIT_S) == 130
    output = log.read_text()
    assert "interrupted: saved" in output, output
    assert not _hidden(run_dir), _hidden(run_dir)
    stopped_at = max(r["step"] for r in _records(run_dir))
    latest = ckpt.latest_checkpoint(run_dir)
    assert latest is not None and latest.name == ckpt.step_name(stopped_at), output
    data = ckpt.read_checkpoint(latest)  # every file whole and readable
    assert data.step == stopped_at and data.weights and data.moments

    resumed = _finish(_train_args("stopped", prepared, resume=True), workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed runs/stopped at step {stopped_at}" in resumed.stderr
    _assert_matches_reference(run_dir, reference, f"stopped at step {stopped_at}")
