"""Run folders under faults of the machine: a full disk at a checkpoint, or at any write of a
resumed run, stops the run in one line and loses nothing already saved."""

from __future__ import annotations

import pytest

from gpuflow.train import checkpoint as ckpt
from gpuflow.train.runfolder import read_metrics
from tests.helpers import train_cli

# ---- faults of the machine -----------------------------------------------------------------


def _disk_full_at(monkeypatch, nth: int) -> None:
    """The checkpoint writer's ``nth`` file write finds the disk full."""
    import errno

    real, calls = ckpt.write_safetensors, []

    def write(path, *args):
        calls.append(path)
        if len(calls) == nth:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args)

    monkeypatch.setattr(ckpt, "write_safetensors", write)


def test_a_full_disk_at_a_checkpoint_stops_the_run_at_once_keeping_the_earlier_ones(
    prepared, workdir, monkeypatch, capsys
):
    _disk_full_at(monkeypatch, 3)  # the second checkpoint's first file
    sets = ("train.checkpoint_interval=2", "train.log_interval=1", "train.eval_interval=1000")
    assert train_cli(prepared, "--name", "full", "--steps", "12", sets=sets) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]  # one line, no traceback
    assert "Traceback" not in err
    assert "No space left on device" in line and "free disk space" in line
    assert "checkpoints are intact: once that is fixed, run it again with --resume" in line
    run = workdir / "runs" / "full"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_000002"]
    ckpt.read_checkpoint(ckpt.latest_checkpoint(run))  # whole
    logged = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert max(logged) <= 5  # stopped within a step or two, not at the next checkpoint
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_full_disk_at_the_first_checkpoint_says_nothing_was_saved(
    prepared, workdir, monkeypatch, capsys
):
    _disk_full_at(monkeypatch, 1)
    assert train_cli(prepared, "--name", "first", "--steps", "4") == 2
    err = capsys.readouterr().err
    assert "no checkpoint of this run was saved yet" in err and "--resume" not in err


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", "runs/faulty/somefile")


@pytest.mark.parametrize(
    "site",
    [
        "gpuflow.train.runfolder.write_config",  # the config, as the resume starts
        "gpuflow.train.runfolder.MetricsLog.write",  # a metrics record
        "gpuflow.train.checkpoint.write_safetensors",  # a checkpoint's file
        "gpuflow.train.report.write_text_atomic",  # report.json, at the end
        "gpuflow.train.report.plot_run",  # training.png, at the end
    ],
)
def test_a_full_disk_at_any_write_of_a_resumed_run_loses_nothing(
    prepared, workdir, monkeypatch, capsys, site
):
    sets = ("train.checkpoint_interval=2", "train.log_interval=1", "train.eval_interval=1000")
    assert train_cli(prepared, "--name", "faulty", "--steps", "2", sets=sets) == 0
    run = workdir / "runs" / "faulty"
    config = (run / "config.toml").read_text()
    records = read_metrics(run)
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(site, _no_space)
        resumed = train_cli(prepared, "--name", "faulty", "--resume", "--steps", "6", sets=sets)
    assert resumed == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "No space left on device" in line and "free disk space" in line, line
    assert "Traceback" not in err
    # What the run had is whole: its checkpoints verify, its records are whole lines that
    # begin with the ones it had, and its config is the one it had or the one it went on with.
    for path in ckpt.list_checkpoints(run):
        ckpt.read_checkpoint(path)
    assert ckpt.list_checkpoints(run)[0].name == "step_000002"
    after = read_metrics(run)
    assert after[: len(records)] == records
    assert (run / "config.toml").read_text() in (config, config.replace("steps = 2", "steps = 6"))
    if ckpt.latest_checkpoint(run).name != "step_000006":  # stopped mid-run: it goes on
        assert train_cli(prepared, "--name", "faulty", "--resume", "--steps", "6", sets=sets) == 0
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 7))
