"""metrics.jsonl of a resumed run: the records an uninterrupted run writes, at the same steps
with the same fields, where the run was stopped (Ctrl-C) or died inside a logging interval."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from gpuflow.device.accelerator import Device
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.checkpoint_record import STATE_FILE, CheckpointDamaged, record_digest
from gpuflow.train.config import resolve_config
from gpuflow.train.meter import IntervalPart
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.step import EagerStep
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

# Records at 4, 8 and 12 (and validation at 0, 6 and 12); the values that are timings or
# memory differ between any two runs, resumed or not.
SETS = ("train.steps=12", "train.log_interval=4", "train.eval_interval=6")
SAME = ("step", "lr", "loss", "grad_norm", "val_loss", "val_bpb")


def _run(prepared: Path, run_dir: Path, *sets: str, resume: bool = False):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", *SETS, *sets])
    return Trainer(config, run_dir, Device("cpu")).run(resume=resume)


def _assert_same_records(resumed: Path, straight: Path, cut: set[int]) -> None:
    """The same records with the same fields; the same values, exactly where the record's
    interval was trained whole in one process, and to rounding where it was cut at a resume
    (its mean is then averaged from the two parts)."""
    ours, theirs = read_metrics(resumed), read_metrics(straight)
    assert [(r["step"], sorted(r)) for r in ours] == [(r["step"], sorted(r)) for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        got = {k: a[k] for k in SAME if k in a}
        want = {k: b[k] for k in SAME if k in b}
        if a["step"] in cut and "loss" in a:
            assert got == pytest.approx(want, rel=1e-12, abs=0), a["step"]
        else:
            assert got == want, a["step"]


def test_a_run_stopped_inside_an_interval_logs_what_an_unstopped_run_logs(
    prepared, workdir, monkeypatch
):
    straight = _run(prepared, workdir / "runs" / "straight").run_dir

    step_of = EagerStep.__call__

    def ctrl_c_during_step_six(self, step: int) -> None:
        step_of(self, step)
        if step == 6:  # as a user's Ctrl-C: the loop stops after the next step, saving it
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(EagerStep, "__call__", ctrl_c_during_step_six)
    run_dir = workdir / "runs" / "stopped"
    stopped = _run(prepared, run_dir)
    assert stopped.interrupted and stopped.last_step == 7
    # No record at the stop: the interval (4, 8] goes on in the resumed run.
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [4]
    carried = json.loads((ckpt.latest_checkpoint(run_dir) / STATE_FILE).read_text())["interval"]
    assert (carried["through"], carried["steps"]) == (7, 3)
    monkeypatch.setattr(EagerStep, "__call__", step_of)

    assert _run(prepared, run_dir, resume=True).start_step == 7
    _assert_same_records(run_dir, straight, cut={8})


def test_a_run_resumed_from_a_checkpoint_inside_an_interval_logs_the_same_curve(prepared, workdir):
    sets = ("train.checkpoint_interval=6", "train.keep_checkpoints=3")
    straight = _run(prepared, workdir / "runs" / "straight", *sets).run_dir
    assert [r["step"] for r in read_metrics(straight) if "loss" in r] == [4, 8, 12]
    run_dir = _run(prepared, workdir / "runs" / "resumed", *sets).run_dir
    for later in ckpt.list_checkpoints(run_dir)[1:]:  # as if it had died after step 6
        shutil.rmtree(later)
    assert _run(prepared, run_dir, *sets, resume=True).start_step == 6
    # Both runs averaged step 8's record from the part before the checkpoint at 6 and the
    # steps after it: the curves are the same bits.
    _assert_same_records(run_dir, straight, cut=set())


def test_an_interval_part_averages_in_the_steps_after_it():
    part = IntervalPart(4).then(7, {"loss": 3.0, "grad_norm": 1.0})
    assert (part.through, part.steps) == (7, 3)
    closed = part.then(8, {"loss": 7.0, "grad_norm": 5.0})
    assert (closed.steps, dict(closed.means)) == (4, {"loss": 4.0, "grad_norm": 2.0})
    assert IntervalPart.from_record(json.loads(json.dumps(part.as_record()))) == part


def test_a_damaged_interval_part_is_refused_in_one_line(prepared, workdir):
    run_dir = _run(prepared, workdir / "runs" / "r", "train.steps=2").run_dir
    checkpoint = ckpt.latest_checkpoint(run_dir)
    written = json.loads((checkpoint / STATE_FILE).read_text())
    for bad in (
        {"through": 7, "steps": 0, "means": {"loss": 1.0}},  # no steps
        {"through": 2, "steps": 3, "means": {"loss": 1.0}},  # steps before step 0
        {"through": 7, "steps": 3, "means": {"loss": "low"}},
        [7, 3],
    ):
        record = {**written, "interval": bad}
        record["state_sha256"] = record_digest(record)  # written so: only the field is wrong
        (checkpoint / STATE_FILE).write_text(json.dumps(record))
        with pytest.raises(CheckpointDamaged, match=r"its interval is .* not the steps and means"):
            ckpt.read_record(checkpoint)
