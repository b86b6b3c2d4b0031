"""TensorBoard and W&B get every record metrics.jsonl gets, read back from their own files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.trackers import TENSORBOARD_DIR
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST, gpuflow_cli

SETS = ("train.steps=6", "train.log_interval=2", "train.eval_interval=3")


def _run(prepared: Path, folder: Path, *sets: str) -> Path:
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", *SETS, *sets])
    return Trainer(config, folder, Device("cpu")).run().run_dir


def _expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's numbers, by name and step."""
    series: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, {})[record["step"]] = float(value)
    return series


def test_tensorboard_event_files_hold_every_metric_of_every_record(prepared, workdir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run(prepared, workdir / "runs" / "tb", "log.tensorboard=true")
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    expected = _expected(run_dir)
    assert {"loss", "val_loss", "val_bpb", "lr", "tokens_per_s"} <= expected.keys()
    assert set(events.Tags()["scalars"]) == expected.keys()
    for name, by_step in expected.items():
        logged = {e.step: e.value for e in events.Scalars(name)}
        assert logged.keys() == by_step.keys(), name
        for step, value in by_step.items():
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (name, step)
    text = events.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"preset": "tiny"' in text and '"device": "cpu"' in text
    # Nothing added to the step: the ledger's counts are those of a run without tracking.
    plain = _expected(_run(prepared, workdir / "runs" / "plain"))
    for field in ("syncs_per_step", "d2h_bytes_per_step", "h2d_bytes_per_step"):
        assert expected[field] == plain[field], field


def test_a_resumed_runs_tensorboard_shows_each_step_once(prepared, workdir):
    """Steps past the checkpoint a run resumes from are trained and recorded again; the
    earlier session's records of them are hidden, as metrics.jsonl drops them."""
    pytest.importorskip("tensorboard")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpuflow.train import checkpoint as ckpt

    sets = ("log.tensorboard=true", "train.checkpoint_interval=3")
    run_dir = _run(prepared, workdir / "runs" / "tb", *sets)
    shutil.rmtree(ckpt.checkpoint_dir(run_dir) / "step_000006")  # as if killed before it
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", *SETS, *sets])
    resumed = Trainer(config, run_dir, Device("cpu")).run(resume=True)
    assert resumed.start_step == 3
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    expected = _expected(run_dir)
    for name in ("loss", "val_loss", "lr"):
        steps = [e.step for e in events.Scalars(name)]
        assert steps == sorted(expected[name]), (name, steps)
        latest = {e.step: e.value for e in events.Scalars(name)}
        assert latest == pytest.approx(expected[name], rel=1e-6), name


def _log_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then
    LevelDB's log format (32 KiB blocks; each record a 7-byte header: checksum, length,
    kind; a record may span blocks as first, middle and last pieces)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        piece = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(piece)
        elif kind == 2:
            pending = piece
        elif kind == 3:
            pending += piece
        elif kind == 4:
            records.append(pending + piece)
    return records


def _wandb_records(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """The history (by name and step) and the config of the one offline W&B run."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, dict[int, float]] = {}
    config: dict = {}
    for data in _log_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            step = items.pop("_step")
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[step] = float(value)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key] = json.loads(item.value_json)
    return history, config


def test_wandb_offline_run_holds_every_metric_and_the_config(prepared, workdir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _run(prepared, workdir / "runs" / "wb", "log.wandb=true", "log.wandb_project=t")
    history, config = _wandb_records(run_dir)
    expected = _expected(run_dir)
    assert "val_bpb" in expected and history.keys() == expected.keys()
    for name, by_step in expected.items():
        assert history[name].keys() == by_step.keys(), name
        for step, value in by_step.items():
            assert history[name][step] == pytest.approx(value, rel=1e-6, abs=1e-30)
    assert config["config"]["preset"] == "tiny" and config["device"]["device"] == "cpu"


def test_wandb_without_a_login_is_one_line_that_says_what_to_do(prepared, workdir, monkeypatch):
    """The package is installed with gpuflow's test extras, so this is where a newcomer who
    sets log.wandb=true stands: it was a traceback from inside wandb, and status 1. (In a
    process of its own: wandb keeps the settings of an earlier run in this one.)"""
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_ANONYMOUS", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    sets = [a for s in (*FAST, f"data.dir={prepared}", "log.wandb=true") for a in ("--set", s)]
    result = gpuflow_cli(
        "train", "--device", "cpu", "--name", "nokey", "--steps", "2", *sets, cwd=workdir,
        env={"HOME": str(workdir), "WANDB_CONFIG_DIR": str(workdir / "wb"), "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert re.search(r"^error: log.wandb could not start a W&B run: .*wandb login.*offline", line)


def test_a_tracker_without_its_package_is_refused_before_the_run_starts(
    prepared, workdir, monkeypatch
):  # fmt: skip
    import builtins

    real_import = builtins.__import__

    def without_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_wandb)
    with pytest.raises(GpuflowError, match=r"pip install 'gpuflow\[wandb\]'"):
        _run(prepared, workdir / "runs" / "nope", "log.wandb=true")
    assert not (workdir / "runs" / "nope").exists()  # refused before its folder was made
