"""Crashes: `kill -9` at random moments, many of them inside checkpoint writes, and SIGINT or
SIGTERM once; after each, `--resume`. Nothing is lost, nothing temporary is left behind, and
the run ends as a run that was never interrupted ends, down to the last bit of its weights.

The runs are real `gpuflow train` processes, started through a small wrapper around gpuflow's
own CLI. To land kills inside checkpoint writes without a hook in gpuflow, the wrapper can make
each safetensors write sleep first, which holds the write's hidden `.step_NNNNNN.tmp-<pid>`
folder open for a while (and likewise two narrower moments of a write: a checkpoint copied as
best, an old one deleted). Only a kill aimed at such a moment slows it; the other kills hit
processes that run at their natural pace.
"""

from __future__ import annotations

import json
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
from tests.helpers import FAST, child_env, gpuflow_cli

STEPS = 80
CHECKPOINT_INTERVAL = 2
RUN_SETS = (
    *FAST,
    "train.log_interval=1",
    f"train.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "train.eval_interval=10",  # some writes also replace checkpoints/best
    "train.lr=0.002",  # validation loss still falling at the last step: it is the best one
)
# One thread per process. With a fixed thread count (1 or 2 were tried) the cpu kernels give
# the same bits in every process, resumed or not, so the weights are compared exactly (1 and 2
# threads differ in the last bits). One thread also leaves a core to the test's polling.
ENV = child_env({"PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"})
# How long the wrapper holds each kind of moment open (seconds), for kills aimed at one: a
# checkpoint write (per file: two files, >= 80 ms), the last step's folder in place before
# its copy as best, an old checkpoint's files deleted before its folder.
SLEEPS = {"write": 0.04, "best": 0.3, "prune": 0.3}
# `python -c WRAPPER '{"write": 0.04}' train ...`: gpuflow's CLI with those moments held.
WRAPPER = """
import json, shutil, sys, time
from pathlib import Path
from gpuflow.interface.cli.main import main
from gpuflow.train import checkpoint

sleeps = json.loads(sys.argv[1])
write, linked_copy, rmtree = checkpoint.write_safetensors, checkpoint._linked_copy, shutil.rmtree

def slow_write(*args):
    time.sleep(sleeps.get("write", 0))
    return write(*args)

def slow_linked_copy(*args):
    made = linked_copy(*args)
    time.sleep(sleeps.get("best", 0))
    return made

def slow_rmtree(path, *args, **kwargs):
    if ".pruned-" in Path(path).name and "prune" in sleeps:
        for file in Path(path).iterdir():
            file.unlink()
        time.sleep(sleeps["prune"])
    return rmtree(path, *args, **kwargs)

checkpoint.write_safetensors = slow_write
checkpoint._linked_copy = slow_linked_copy
shutil.rmtree = slow_rmtree
sys.exit(main(sys.argv[2:]))
"""
WAIT_S = 120  # for any one moment or process (2 shared cores can be slow)
POLL_S = 0.005
# Random kills stop short of the end: the last checkpoint, its best copy and the report are
# the subject of a test of their own.
LAST_KILL_STEP = STEPS - 8
LAST_KILLED_WRITE = STEPS - 4


def _train_args(name: str, data: Path, resume: bool = False) -> list[str]:
    args = ["train", "--name", name, "--steps", str(STEPS), "--device", "cpu"]
    for setting in (*RUN_SETS, f"data.dir={data}"):
        args += ["--set", setting]
    return [*args, "--resume"] if resume else args


@contextmanager
def _launched(
    args: list[str], cwd: Path, log: Path, sleeps: dict[str, float]
) -> Iterator[subprocess.Popen]:
    """A training process started through the wrapper, its output in ``log``; killed on the
    way out if it is still running (a failed test leaves no process behind)."""
    argv = [sys.executable, "-c", WRAPPER, json.dumps(sleeps), *args]
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
    return gpuflow_cli(*args, cwd=cwd, timeout=WAIT_S * 2, env=ENV)


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


def _half_deleted(run_dir: Path) -> set[str]:
    """``step_*`` folders without their state.json: none should outlive a process."""
    folder = ckpt.checkpoint_dir(run_dir)
    names = folder.iterdir() if folder.is_dir() else ()
    return {
        p.name
        for p in names
        if p.name.startswith(ckpt.STEP_PREFIX) and not (p / ckpt.STATE_FILE).exists()
    }


def _listing(run_dir: Path) -> list[str]:
    """Every file and folder under ``run_dir``, relative to it."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def _resume_step(run_dir: Path) -> int:
    latest = ckpt.latest_checkpoint(run_dir)
    return ckpt.read_record(latest)["step"] if latest else 0


# ---- the uninterrupted run everything is compared with ------------------------------------


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    losses: list[tuple[int, float]]
    val_steps: list[int]
    best_step: int


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
        best_step=ckpt.read_record(ckpt.checkpoint_dir(run_dir) / ckpt.BEST)["step"],
    )


def _assert_matches_reference(run_dir: Path, reference: Reference, story: str) -> None:
    """Nothing lost or repeated, nothing temporary left, the uninterrupted run's files, best
    checkpoint, weights and loss curve, bit for bit (see ENV); ``story`` says what happened."""
    records = _records(run_dir)
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    steps = [step for step, _ in losses]
    assert steps == list(range(1, STEPS + 1)), f"loss records lost or repeated; {story}"
    assert not _hidden(run_dir), f"temporaries left: {_hidden(run_dir)}; {story}"
    ours, theirs = ckpt.checkpoint_dir(run_dir), ckpt.checkpoint_dir(reference.run_dir)
    best = ckpt.read_record(ours / ckpt.BEST)["step"]
    assert best == reference.best_step, (
        f"checkpoints/best is step {best}, the uninterrupted run's step {reference.best_step}; "
        + story
    )
    listed, expected = set(_listing(run_dir)), set(_listing(reference.run_dir))
    assert listed == expected, (
        f"extra: {sorted(listed - expected)}, missing: {sorted(expected - listed)}; {story}"
    )
    for folder in (ckpt.step_name(STEPS), ckpt.BEST):
        for name in (ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE):
            assert (ours / folder / name).read_bytes() == (theirs / folder / name).read_bytes(), (
                f"{folder}/{name} differs from the uninterrupted run's; {story}"
            )
    assert losses == reference.losses, f"the loss curve differs; {story}"
    val_steps = [r["step"] for r in records if "val_loss" in r]
    assert val_steps == reference.val_steps, (
        f"validation records at steps {val_steps}, not {reference.val_steps}; {story}"
    )


# ---- kill -9 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """When to kill a process: ``launch``, ``delay`` seconds after it starts (starting takes
    about 2 s: importing torch, cleaning up, restoring; then it trains); ``step``, once it has
    logged step resumed + ``ahead``; ``write``, while its ``ahead``-th checkpoint write is in
    flight; ``best``, while the last step's copy as best is made and its own folder is not yet
    in place; ``prune``, while an old checkpoint, moved out of sight, is being deleted. Then
    ``delay`` seconds more (a ``launch`` kill's delay is its moment)."""

    kind: str
    ahead: int = 0
    delay: float = 0.0

    @property
    def then(self) -> float:
        """Seconds from the moment to the kill."""
        return 0.0 if self.kind == "launch" else self.delay

    @property
    def sleeps(self) -> dict[str, float]:
        """What the wrapper holds open: only the moment this kill is aimed at."""
        return {self.kind: SLEEPS[self.kind]} if self.kind in SLEEPS else {}


def random_plan(seed: int, count: int) -> list[Kill]:
    """``count`` kills, reproducibly: 1 in 5 at a time after launch, 2 in 5 just after a step,
    2 in 5 inside a write."""
    rng = random.Random(seed)
    plan = []
    for kind in rng.choices(("launch", "step", "write"), weights=(1, 2, 2), k=count):
        if kind == "launch":
            plan.append(Kill(kind, 0, rng.uniform(0.5, 2.5)))
        elif kind == "step":
            plan.append(Kill(kind, rng.randint(1, 5), rng.uniform(0.0, 0.03)))
        else:  # well inside the write's two sleeps
            plan.append(Kill(kind, rng.randint(1, 3), rng.uniform(0.0, 0.05)))
    return plan


def _moment(kill: Kill, run_dir: Path) -> Callable[[subprocess.Popen], bool]:
    """Whether ``kill``'s moment (before its delay) has come for a process started just after
    this call."""
    start = _resume_step(run_dir)
    metrics = run_dir / "metrics.jsonl"
    before = _file_id(metrics)  # a resumed run rewrites the file: then its records are its own
    launched = time.monotonic()
    folder = ckpt.checkpoint_dir(run_dir)

    def logged(step: int) -> bool:
        if _file_id(metrics) in (before, None):
            return False
        return max(_logged_steps(run_dir), default=0) >= step

    if kill.kind == "launch":
        return lambda proc: time.monotonic() - launched >= kill.delay or logged(LAST_KILL_STEP)
    if kill.kind == "step":
        return lambda proc: logged(min(start + kill.ahead, LAST_KILL_STEP))
    if kill.kind == "best":
        last = folder / ckpt.step_name(STEPS)
        return lambda proc: (folder / f".best.tmp-{proc.pid}").exists() and not last.is_dir()
    if kill.kind == "prune":
        return lambda proc: folder.is_dir() and any(".pruned-" in p.name for p in folder.iterdir())
    step = (start // CHECKPOINT_INTERVAL + kill.ahead) * CHECKPOINT_INTERVAL
    tmp = f".{ckpt.step_name(min(step, LAST_KILLED_WRITE))}.tmp-"
    return lambda proc: (folder / f"{tmp}{proc.pid}").exists()


@dataclass
class Crashes:
    """What ``crash_and_resume`` did."""

    run_dir: Path
    story: list[str]  # one line per kill, then the last --resume's exit status
    final: subprocess.CompletedProcess

    @property
    def inside_writes(self) -> int:
        return sum("inside a write" in line for line in self.story)

    def report(self) -> str:
        kills = len(self.story) - 1
        summary = f"{kills} kills, {self.inside_writes} inside a checkpoint write"
        return "\n".join([summary, *self.story])


def crash_and_resume(workdir: Path, data: Path, plan: list[Kill]) -> Crashes:
    """Kill the run at each moment of ``plan`` and start it again (with ``--resume`` once it
    has a folder), then let it finish."""
    run_dir = workdir / "runs" / "crash"
    story = []
    for number, kill in enumerate(plan, start=1):
        args = _train_args("crash", data, resume=run_dir.exists())
        log = workdir / f"attempt{number:02d}.log"
        start, moment = _resume_step(run_dir), _moment(kill, run_dir)
        metrics, halves = _file_id(run_dir / "metrics.jsonl"), _half_deleted(run_dir)
        with _launched(args, workdir, log, kill.sleeps) as proc:
            came = _wait_until(moment, proc)
            time.sleep(kill.then)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL, (
                f"kill {number} ({kill}) found the process ended (its moment came: {came}):\n"
                + log.read_text()
            )
        own = _file_id(run_dir / "metrics.jsonl") not in (metrics, None)
        reached = max(_logged_steps(run_dir), default=0) if own else start
        when = f"after step {reached:2d}" if reached > start else "before its first step"
        left = [n for n in _hidden(run_dir) if n.endswith(f"-{proc.pid}")]
        where = f"inside a write, left {', '.join(left)}" if left else "left no temporary"
        if halves := sorted(_half_deleted(run_dir) - halves):
            where += f", and half of {', '.join(halves)} (it was deleting it)"
        story.append(f"kill {number:2d} ({kill.kind}) from step {start:2d} {when}: {where}")
    final = _finish(_train_args("crash", data, resume=run_dir.exists()), workdir)
    errors = [line for line in final.stderr.splitlines() if line.startswith("error")]
    story.append(f"then --resume: exit status {final.returncode} {' '.join(errors)}".rstrip())
    return Crashes(run_dir, story, final)


def _assert_recovered(crashes: Crashes, reference: Reference) -> None:
    """The crashed run ended as the uninterrupted one, and its last resume said so."""
    _assert_matches_reference(crashes.run_dir, reference, crashes.report())
    assert crashes.final.returncode == 0, crashes.report() + "\n" + crashes.final.stderr


def test_kill_9_three_times_then_resume_loses_nothing(workdir, prepared, reference):
    # Kills at three different places of the run (after its first checkpoint: a kill before
    # it is a test of its own), two while a checkpoint is being written.
    plan = [Kill("write", 2, 0.02), Kill("step", 3, 0.01), Kill("write", 3, 0.03)]
    crashes = crash_and_resume(workdir, prepared, plan)
    print(crashes.report())
    _assert_recovered(crashes, reference)
    assert crashes.inside_writes >= 1, crashes.report()


@pytest.mark.slow
def test_kill_9_at_twenty_random_moments_then_resume_loses_nothing(workdir, prepared, reference):
    crashes = crash_and_resume(workdir, prepared, random_plan(seed=20, count=20))
    print(crashes.report())
    _assert_recovered(crashes, reference)
    assert crashes.inside_writes >= 4, crashes.report()


def test_a_kill_before_the_first_checkpoint_logs_the_baseline_once(workdir, prepared, reference):
    # The run has logged its step-0 validation loss; killed while its first checkpoint is being
    # written, its resume starts again from step 0.
    _assert_recovered(crash_and_resume(workdir, prepared, [Kill("write", 1)]), reference)


def test_a_kill_between_the_last_checkpoint_and_its_best_copy_loses_nothing(
    workdir, prepared, reference
):
    # The last step's copy as best is made, its folder is not yet in place: the run must not
    # look finished with an old best, and the resume repeats the last steps.
    assert reference.best_step == STEPS, "the last validation loss must be the run's best"
    _assert_recovered(crash_and_resume(workdir, prepared, [Kill("best")]), reference)


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_part_of_it(
    workdir, prepared, reference
):
    # The first write past train.keep_checkpoints deletes the oldest checkpoint: killed once
    # its files are gone and its folder, moved out of sight first, is not.
    _assert_recovered(crash_and_resume(workdir, prepared, [Kill("prune")]), reference)


# ---- SIGINT and SIGTERM ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "kill"),
    [(signal.SIGINT, Kill("write", 3, 0.02)), (signal.SIGTERM, Kill("step", 6))],
    ids=["sigint-inside-a-write", "sigterm-between-writes"],
)
def test_a_signal_saves_where_the_run_stops_and_resume_matches(
    workdir, prepared, reference, sig, kill
):
    run_dir, log = workdir / "runs" / "stopped", workdir / "stopped.log"
    moment = _moment(kill, run_dir)
    with _launched(_train_args("stopped", prepared), workdir, log, kill.sleeps) as proc:
        assert _wait_until(moment, proc), log.read_text()
        time.sleep(kill.then)
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

    print(f"stopped at step {stopped_at}")

    resumed = _finish(_train_args("stopped", prepared, resume=True), workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed runs/stopped at step {stopped_at}" in resumed.stderr
    _assert_matches_reference(run_dir, reference, f"stopped at step {stopped_at}")
