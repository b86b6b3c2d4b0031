"""The checkpoint writer: files written on a thread from one snapshot, standard safetensors
out, and nothing half-written on failure (the snapshot itself: tests/transfer/test_snapshot.py)."""

from __future__ import annotations

import errno
import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import TrainConfig
from gpuflow.train.optim.adamw import build_optimizer
from gpuflow.transfer.snapshot import StateSnapshot
from tests.helpers import load_checkpoint, mixed_state, save_checkpoint


def test_written_files_are_standard_safetensors(tmp_path):
    snap = StateSnapshot("cpu").capture(mixed_state())
    snap.wait()
    path = tmp_path / "model.safetensors"
    written = ckpt.write_safetensors(path, snap.layout.groups["model"], snap.group_bytes("model"))
    assert written["bytes"] == path.stat().st_size
    assert written["sha256"] == ckpt.file_digest(path)
    loaded = load_file(str(path))
    for name, tensor in mixed_state()["model"].items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
    assert torch.equal(loaded["w"], snap.tensors("model")["w"])
    assert torch.equal(loaded["flag"], torch.tensor([True, False, True]))


def _model_and_optimizer():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, max_len=8)
    model = GPT(config)
    optimizer = build_optimizer(model, TrainConfig(), Device("cpu"))
    ids = torch.randint(0, 64, (2, 8))
    model(ids, ids).backward()
    optimizer.step()
    return config, model, optimizer


def test_save_returns_while_the_files_are_written(tmp_path, monkeypatch):
    _, model, optimizer = _model_and_optimizer()
    writing, go_on = threading.Event(), threading.Event()
    real_write = ckpt.write_safetensors

    def slow_write(*args):
        writing.set()
        go_on.wait(timeout=10)
        return real_write(*args)

    monkeypatch.setattr(ckpt, "write_safetensors", slow_write)
    checkpointer = ckpt.Checkpointer(tmp_path, Device("cpu"), keep=2)
    checkpointer.save(5, model, optimizer, {"note": "x"})
    assert writing.wait(timeout=10)
    assert ckpt.latest_checkpoint(tmp_path) is None  # training goes on; nothing renamed yet
    with torch.no_grad():
        model.ln_f.weight.add_(1.0)  # the next steps change the weights meanwhile
    go_on.set()
    checkpointer.close()
    [saved] = ckpt.list_checkpoints(tmp_path)
    assert saved.name == "step_000005"
    weights = load_file(str(saved / "model.safetensors"))
    assert torch.equal(weights["ln_f.weight"] + 1.0, model.ln_f.weight)  # as when saved
    record = json.loads((saved / "state.json").read_text())
    model_file = saved / "model.safetensors"
    assert record["files"]["model.safetensors"] == {
        "bytes": model_file.stat().st_size, "sha256": ckpt.file_digest(model_file)
    }  # fmt: skip
    assert checkpointer.write_seconds and checkpointer.written == [saved]


def test_a_failed_write_is_reported_and_leaves_the_earlier_checkpoints(tmp_path, monkeypatch):
    config, model, optimizer = _model_and_optimizer()
    checkpointer = ckpt.Checkpointer(tmp_path, Device("cpu"), keep=2)
    checkpointer.save(1, model, optimizer, {})
    checkpointer.wait()

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_safetensors", full_disk)
    checkpointer.save(2, model, optimizer, {})
    with pytest.raises(GpuflowError, match=r"No space left on device.*earlier checkpoints are"):
        checkpointer.wait()
    folder = ckpt.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["step_000001"]  # no temporary left
    again = GPT(config)
    load_checkpoint(
        folder / "step_000001", again, build_optimizer(again, TrainConfig(), Device("cpu"))
    )


def test_best_shares_the_files_of_its_step_and_outlives_pruning(tmp_path):
    _, model, optimizer = _model_and_optimizer()
    checkpointer = ckpt.Checkpointer(tmp_path, Device("cpu"), keep=1)
    checkpointer.save(1, model, optimizer, {"val_loss": 3.0}, ("step_000001", ckpt.BEST))
    checkpointer.save(2, model, optimizer, {"val_loss": 3.5})
    checkpointer.close()
    folder = ckpt.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["best", "step_000002"]
    assert ckpt.read_record(folder / "best")["step"] == 1


def test_files_the_user_put_in_checkpoints_outlive_pruning_and_replacement(tmp_path):
    # docs/cli.md: gpuflow removes or replaces only what it wrote in a run folder.
    _, model, optimizer = _model_and_optimizer()
    checkpointer = ckpt.Checkpointer(tmp_path, Device("cpu"), keep=1)
    checkpointer.save(1, model, optimizer, {"val_loss": 3.0}, ("step_000001", ckpt.BEST))
    checkpointer.wait()
    folder = ckpt.checkpoint_dir(tmp_path)
    (folder / "step_000001" / "NOTES.txt").write_text("why this one")
    (folder / ckpt.BEST / "WHY_BEST.txt").write_text("lowest so far")
    checkpointer.save(2, model, optimizer, {"val_loss": 2.0}, ("step_000002", ckpt.BEST))
    checkpointer.save(3, model, optimizer, {"val_loss": 2.5})
    checkpointer.close()
    # step 1 holds the user's note: kept whole past keep=1; step 2 pruned as usual
    assert sorted(p.name for p in folder.iterdir()) == ["best", "step_000001", "step_000003"]
    assert (folder / "step_000001" / "NOTES.txt").read_text() == "why this one"
    assert ckpt.read_record(folder / "step_000001")["step"] == 1
    # best replaced by step 2's, the user's file moved along with it
    assert ckpt.read_record(folder / ckpt.BEST)["step"] == 2
    assert (folder / ckpt.BEST / "WHY_BEST.txt").read_text() == "lowest so far"


def test_a_replacement_that_fails_leaves_the_users_files_where_they_were(tmp_path, monkeypatch):
    _, model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 3, model, optimizer, {}, keep=3)
    (path / "NOTES.txt").write_text("mine")
    successor = ckpt._linked_copy(path, path.parent / ".step_000003.tmp-4242")
    (successor / "NOTES.txt").unlink()  # a successor holds only what gpuflow writes

    def refused(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "replace_folder", refused)
    with pytest.raises(OSError):
        ckpt._install(successor, path)
    assert (path / "NOTES.txt").read_text() == "mine"


def test_a_replacement_killed_after_moving_the_users_files_gives_them_back(tmp_path):
    _, model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 3, model, optimizer, {}, keep=3)
    successor = path.parent / ".step_000003.tmp-4242"  # killed before it was renamed in
    successor.mkdir()
    (successor / "NOTES.txt").write_text("mine")
    assert ckpt.remove_stale_temporaries(tmp_path) == [".step_000003.tmp-4242"]
    assert (path / "NOTES.txt").read_text() == "mine"
    assert ckpt.read_record(path)["step"] == 3


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (
            lambda m, k: m.__setitem__(k, torch.zeros(3, 3)),
            r"exp_avg is \(3, 3\), not the parameter.s",
        ),
        (lambda m, k: m.pop(k), "has no exp_avg; the checkpoint is damaged"),
        (
            lambda m, k: m.__setitem__(k.replace("exp_avg", "step"), torch.zeros(5)),
            "its step is not one number",
        ),
    ],
    ids=["shape", "missing", "step"],
)
def test_moments_that_do_not_fit_their_parameters_are_one_line(tmp_path, damage, said):
    # A record whose checksums hold may come from another writer: its moments are checked
    # against the live parameters before torch would fail in the middle of a step.
    _, model, optimizer = _model_and_optimizer()
    data = ckpt.read_checkpoint(save_checkpoint(tmp_path, 1, model, optimizer, {}, keep=1))
    key = next(k for k in data.moments if k.endswith(".exp_avg"))
    damage(data.moments, key)
    with pytest.raises(GpuflowError, match=said):
        ckpt.apply_checkpoint(data, model, optimizer)


def test_a_replacement_cut_short_gives_the_old_checkpoint_back(tmp_path):
    _, model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 3, model, optimizer, {}, keep=3)
    retired = path.with_name(".step_000003.old-4242")  # moved aside, its successor lost
    path.rename(retired)
    (path.parent / ".step_000004.tmp-4242").mkdir()
    assert ckpt.remove_stale_temporaries(tmp_path) == [
        ".step_000003.old-4242",
        ".step_000004.tmp-4242",
    ]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000003"]


def test_a_run_folder_removed_during_the_run_is_not_made_again(tmp_path):
    _, model, optimizer = _model_and_optimizer()
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    checkpointer = ckpt.Checkpointer(run_dir, Device("cpu"), keep=2)
    checkpointer.save(1, model, optimizer, {})
    checkpointer.wait()
    shutil.rmtree(run_dir)  # a user's rm -rf while it trains
    checkpointer.save(2, model, optimizer, {})
    with pytest.raises(GpuflowError, match=r"the run folder .*r was removed or moved"):
        checkpointer.wait()
    assert list((tmp_path / "runs").iterdir()) == []
