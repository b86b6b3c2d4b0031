"""Run folders: nothing half-written, nothing left behind, resumes that cannot go wrong
quietly, and the best checkpoint."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import Shard, write_shard
from gpuflow.device.accelerator import Device
from gpuflow.interface.cli.main import main
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import RunFolder, latest_run_dir, read_metrics
from gpuflow.train.schedule import lr_at
from gpuflow.train.step import EagerStep
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST, train_cli


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- a failed start leaves nothing behind ---------------------------------------------------


def test_a_failure_after_the_folder_exists_removes_it_and_the_name_is_free(
    prepared, workdir, monkeypatch, capsys
):
    def broken(*args, **kwargs):
        raise GpuflowError("the first step failed")

    with monkeypatch.context() as patch:
        patch.setattr(EagerStep, "__call__", broken)
        assert train_cli(prepared, "--name", "x", "--steps", "4") == 2
    assert "the first step failed" in capsys.readouterr().err
    assert not (workdir / "runs" / "x").exists()
    assert train_cli(prepared, "--name", "x", "--steps", "2") == 0  # no "already exists"
    assert (workdir / "runs" / "x" / "checkpoints" / "step_000002").is_dir()


def test_a_failed_resume_keeps_the_config_it_had(prepared, workdir, monkeypatch, capsys):
    assert train_cli(prepared, "--name", "r", "--steps", "2") == 0
    config_before = (workdir / "runs" / "r" / "config.toml").read_text()

    def broken(*args, **kwargs):
        raise GpuflowError("the first step failed")

    with monkeypatch.context() as patch:
        patch.setattr(EagerStep, "__call__", broken)
        code = train_cli(
            prepared, "--name", "r", "--resume", "--steps", "3", sets=("train.lr=1e-5",)
        )
    assert code == 2
    assert (workdir / "runs" / "r" / "config.toml").read_text() == config_before
    capsys.readouterr()
    assert train_cli(prepared, "--name", "r", "--resume", "--steps", "3") == 0


def test_a_failed_run_with_a_best_checkpoint_is_kept(prepared, workdir, monkeypatch, capsys):
    """The best weights so far are work worth keeping, even without a step checkpoint."""
    real = Trainer.evaluate
    calls = []

    def third_fails(self):
        calls.append(1)
        if len(calls) == 3:  # at step 4, after the best was saved at step 2
            raise GpuflowError("evaluation failed")
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", third_fails)
    sets = ("train.eval_interval=2",)
    assert train_cli(prepared, "--name", "kept", "--steps", "6", sets=sets) == 2
    run = workdir / "runs" / "kept"
    assert ckpt.read_record(ckpt.best_checkpoint(run))["step"] == 2
    assert (run / "config.toml").is_file() and not ckpt.list_checkpoints(run)


def test_a_one_line_corpus_is_refused_before_anything_is_written(workdir, capsys):
    data = workdir / "oneline"
    data.mkdir()
    write_shard(data / "train_000000.bin", np.arange(20, dtype=np.uint16))
    write_shard(data / "val_000000.bin", np.arange(20, dtype=np.uint16))
    before = _files(workdir)
    assert train_cli(data, "--name", "short") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no run of 33 tokens" in err[0], err
    assert _files(workdir) == before


def test_ids_past_the_vocabulary_are_refused_whatever_meta_json_says(data_copy, workdir, capsys):
    """meta.json still claims a small largest id; a shard replaced since holds a larger one."""
    assert json.loads((data_copy / "meta.json").read_text())["max_token"] < 512
    shard = Shard.open(next(data_copy.glob("train_*.bin")))
    tokens = np.array(shard.tokens)
    tokens[len(tokens) // 2] = 4000
    write_shard(shard.path, tokens)
    before = _files(workdir)
    for path in ("resident", "streamed"):
        code = train_cli(data_copy, "--steps", "2", sets=(f"train.data_path={path}",))
        assert code == 2, path
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "train_000000.bin holds token id 4000" in err[0], (path, err)
        assert "model.vocab_size is 512" in err[0]
    assert _files(workdir) == before


def test_out_of_memory_is_one_line_naming_what_to_lower(prepared, workdir, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 3.42 GiB is free. Including non-PyTorch memory, ..."
        )

    monkeypatch.setattr(EagerStep, "__call__", out_of_memory)
    assert train_cli(prepared, "--name", "big", "--steps", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == err[-1:], err
    assert (
        "out of device memory on cpu (20.00 GiB more was needed, 3.42 GiB of 79.19 GiB" in err[-1]
    )
    assert (
        "train.batch_size (the micro-batch, now 8;" in err[-1]
        and "model.max_len (now 32)" in err[-1]
    )
    assert "removed runs/big: the run failed before its first checkpoint" in err
    assert err[-1].endswith("no checkpoint was written yet")  # not "checkpoints are intact"
    assert not (workdir / "runs" / "big").exists()


# ---- what a killed run leaves: temporaries, torn lines ----------------------------------------


def test_stale_temporaries_are_cleared_and_never_taken_for_checkpoints(prepared, workdir, capsys):
    assert train_cli(prepared, "--name", "k", "--steps", "2") == 0
    folder = workdir / "runs" / "k" / "checkpoints"
    tmp = folder / ".step_000004.tmp-99999"  # a write killed half-way
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    (tmp / "state.json").write_text('{"step": 4}')
    retired = folder / ".step_000002.old-99999"  # a complete one moved aside to be replaced
    os.replace(folder / "step_000002", retired)
    (workdir / "runs" / "k" / ".config.toml.tmp-99999").write_text("half")
    assert ckpt.latest_checkpoint(workdir / "runs" / "k") is None
    capsys.readouterr()
    assert train_cli(prepared, "--name", "k", "--resume", "--steps", "3") == 0
    err = capsys.readouterr().err
    assert "removed what an interrupted run left" in err
    assert "resumed runs/k at step 2 from step_000002" in err  # put back, then resumed from
    assert sorted(p.name for p in folder.iterdir()) == ["best", "step_000002", "step_000003"]
    assert not (workdir / "runs" / "k" / ".config.toml.tmp-99999").exists()


# ---- a run folder holds only what gpuflow wrote there, and it crosses no link ---------------


def _trained(prepared, workdir, name: str):
    assert (
        train_cli(prepared, "--name", name, "--steps", "2", sets=("train.checkpoint_interval=1",))
        == 0
    )
    return workdir / "runs" / name


def _refused_resume(prepared, name: str, capsys) -> str:
    capsys.readouterr()
    assert train_cli(prepared, "--name", name, "--resume", "--steps", "4") != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line
    return err


def test_resume_never_removes_a_step_folder_it_did_not_write(prepared, workdir, capsys):
    run = _trained(prepared, workdir, "mine")
    theirs = run / "checkpoints" / "step_000007"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user's own file")
    err = _refused_resume(prepared, "mine", capsys)
    assert "step_000007 is not a checkpoint gpuflow wrote" in err
    assert (theirs / "notes.txt").read_text() == "the user's own file"


def test_a_run_folder_that_is_a_link_is_refused_and_its_target_untouched(prepared, workdir, capsys):
    elsewhere = workdir / "elsewhere"
    _trained(prepared, workdir, "real").rename(elsewhere)  # someone else's run, say
    before = _files(elsewhere)
    (workdir / "runs" / "lnk").symlink_to(elsewhere)
    err = _refused_resume(prepared, "lnk", capsys)
    assert "runs/lnk is a link" in err and "pass the folder itself" in err
    assert _files(elsewhere) == before


def test_a_checkpoint_without_its_state_keeps_its_weights(prepared, workdir, capsys):
    run = _trained(prepared, workdir, "lost")
    step = run / "checkpoints" / "step_000002"
    (step / "state.json").unlink()  # deleted by hand
    err = _refused_resume(prepared, "lost", capsys)
    assert "put its state.json back" in err
    assert (step / "model.safetensors").is_file() and (step / "optimizer.safetensors").is_file()


@pytest.mark.parametrize("kind", ["file", "link", "linked step"])
def test_a_checkpoints_file_or_link_is_refused_and_nothing_is_lost(prepared, workdir, capsys, kind):
    run = _trained(prepared, workdir, "odd")
    metrics = (run / "metrics.jsonl").read_text()
    outside = workdir / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    folder = run / "checkpoints"
    if kind == "linked step":
        (folder / "step_000009").symlink_to(outside, target_is_directory=True)
    else:
        shutil.rmtree(folder)
        if kind == "file":
            folder.write_text("a file where the folder was")
        else:
            folder.symlink_to(outside, target_is_directory=True)
    err = _refused_resume(prepared, "odd", capsys)
    assert "will not follow or replace it" in err or "is not a checkpoint gpuflow wrote" in err
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing wiped
    assert (outside / "keep.txt").read_text() == "not the run's"
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_a_torn_last_metrics_line_is_dropped_and_said(prepared, workdir, capsys):
    assert train_cli(prepared, "--name", "t", "--steps", "2", sets=("train.log_interval=1",)) == 0
    metrics = workdir / "runs" / "t" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 5.1')  # the power went out here
    assert [r["step"] for r in read_metrics(workdir / "runs" / "t")][-1] == 2
    capsys.readouterr()
    assert train_cli(prepared, "--name", "t", "--resume", "--steps", "3") == 0
    assert "dropped the torn last line of metrics.jsonl" in capsys.readouterr().err
    lines = metrics.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # every line whole again
    assert [json.loads(line)["step"] for line in lines if "loss" in line][-1] == 3


def test_a_second_process_cannot_train_the_same_run(prepared, workdir):
    assert train_cli(prepared, "--name", "busy", "--steps", "2") == 0
    with RunFolder(workdir / "runs" / "busy", resume=True):
        config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=3"])
        with pytest.raises(GpuflowError, match="in use by another gpuflow process"):
            Trainer(config, workdir / "runs" / "busy", Device("cpu")).run(resume=True)


# ---- resume pitfalls ------------------------------------------------------------------------


def test_a_bare_resume_never_picks_a_profile_folder(prepared, workdir, capsys):
    assert train_cli(prepared, "--name", "real", "--steps", "2") == 0
    profile = workdir / "runs" / "profile-tiny"  # as an older `gpuflow profile` left it
    profile.mkdir()
    (profile / "config.toml").write_text((workdir / "runs" / "real" / "config.toml").read_text())
    (profile / "profile.json").write_text("{}")
    assert latest_run_dir().resolve() == workdir / "runs" / "real"
    assert main(["train", "--name", "profile-tiny", "--resume", "--device", "cpu"]) == 2
    assert "runs/profile-tiny is not a gpuflow run" in capsys.readouterr().err


def test_a_resume_without_a_checkpoint_says_it_starts_over(prepared, workdir, capsys):
    assert train_cli(prepared, "--name", "c", "--steps", "2") == 0
    shutil.rmtree(workdir / "runs" / "c" / "checkpoints")  # killed before its first one
    capsys.readouterr()
    assert train_cli(prepared, "--name", "c", "--resume", "--steps", "2") == 0
    assert "has no checkpoint yet: training it from step 0" in capsys.readouterr().err


def test_more_steps_after_the_end_asks_how_to_extend_the_schedule(prepared, workdir, capsys):
    sets = ("train.warmup_steps=2", "train.lr=0.003")
    assert train_cli(prepared, "--name", "s", "--steps", "6", sets=sets) == 0
    capsys.readouterr()
    assert train_cli(prepared, "--name", "s", "--resume", "--steps", "12") == 2
    err = capsys.readouterr().err
    assert "scheduled over 6 steps and stopped at step 6; with 12 its next step" in err
    assert "--set train.decay_steps=6 to keep the schedule" in err
    assert "--set train.decay_steps=12 to stretch it" in err
    # Keeping it: the extra steps train at the schedule's final rate.
    keep = ("train.decay_steps=6",)
    assert train_cli(prepared, "--name", "s", "--resume", "--steps", "12", sets=keep) == 0
    lrs = {r["step"]: r["lr"] for r in read_metrics(workdir / "runs" / "s") if "lr" in r}
    assert [step for step in lrs if step > 6] == [10, 12]
    assert all(lrs[step] == pytest.approx(0.003 * 0.1) for step in (10, 12))


def test_the_original_command_with_resume_added_is_accepted(prepared, workdir, capsys):
    args = ["--preset", "tiny", "--name", "p", "--steps", "2"]
    assert train_cli(prepared, *args) == 0
    capsys.readouterr()
    assert train_cli(prepared, *args[:-1], "3", "--resume") == 0
    assert "resumed runs/p at step 2" in capsys.readouterr().err
    different = ("train.lr=0.0001",)
    assert train_cli(prepared, *args[:-1], "4", "--resume", sets=different) == 0  # --set: fine
    capsys.readouterr()
    code = main(["train", "--preset", "seed-d384", "--name", "p", "--resume", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "drop --preset/--config (use --set to change a setting)" in err
    assert "model.vocab_size is 512 in the run, 16000 here" in err


def test_resume_refuses_data_with_another_tokenizer(prepared, data_copy, workdir, capsys):
    assert train_cli(data_copy, "--name", "d", "--steps", "2") == 0
    tokenizer = data_copy / "tokenizer.json"  # another tokenizer of the same vocabulary
    text = tokenizer.read_text()
    tokenizer.write_text(text.replace('"add_prefix_space": false', '"add_prefix_space": true', 1))
    assert tokenizer.read_text() != text
    capsys.readouterr()
    assert train_cli(data_copy, "--name", "d", "--resume", "--steps", "3") == 2
    assert "is not the tokenizer runs/d was trained with" in capsys.readouterr().err


# ---- the best checkpoint, divergence, repeated passes -----------------------------------------


def test_the_best_validation_checkpoint_is_kept_apart(prepared, workdir):
    sets = ("train.eval_interval=2", "train.checkpoint_interval=3", "train.keep_checkpoints=1")
    assert train_cli(prepared, "--name", "b", "--steps", "6", sets=sets) == 0
    run = workdir / "runs" / "b"
    val = {r["step"]: r["val_loss"] for r in read_metrics(run) if "val_loss" in r}
    best_step = min((s for s in val if s > 0), key=val.get)
    best = ckpt.best_checkpoint(run)
    record = ckpt.read_record(best)
    assert record["step"] == best_step and record["val_loss"] == pytest.approx(val[best_step])
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_000006"]  # best not pruned
    weights = ckpt.read_checkpoint(best).weights
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_an_unclipped_run_logs_the_gradients_norm_not_zero(prepared, workdir):
    norms = {}
    for name, clip in (("noclip", "0"), ("hugeclip", "1e9")):  # a clip that never bites
        sets = (f"train.grad_clip={clip}", "train.log_interval=1")
        assert train_cli(prepared, "--name", name, "--steps", "3", sets=sets) == 0
        records = read_metrics(workdir / "runs" / name)
        norms[name] = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert len(norms["noclip"]) == 3 and all(n > 0 for n in norms["noclip"]), norms
    assert norms["noclip"] == pytest.approx(norms["hugeclip"], rel=1e-5)


def test_a_diverged_run_stops_before_saving_nan_weights(prepared, workdir, capsys):
    sets = ("train.lr=1e6", "train.grad_clip=0", "train.warmup_steps=1", "train.log_interval=1")
    assert train_cli(prepared, "--name", "nan", "--steps", "30", sets=sets) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "training diverged: the loss is nan" in err[-1] and "lower train.lr" in err[-1], err
    for path in ckpt.list_checkpoints(workdir / "runs" / "nan"):
        weights = ckpt.read_checkpoint(path).weights
        assert all(torch.isfinite(t).all() for t in weights.values()), path


def test_a_resumed_run_that_diverges_names_the_checkpoint_an_earlier_session_left(
    prepared, workdir, capsys
):
    assert (
        train_cli(prepared, "--name", "rd", "--steps", "2", sets=("train.checkpoint_interval=2",))
        == 0
    )
    capsys.readouterr()
    # no checkpoint of its own before it diverges
    sets = (
        "train.lr=1e6",
        "train.grad_clip=0",
        "train.log_interval=1",
        "train.checkpoint_interval=1000",
    )
    assert train_cli(prepared, "--name", "rd", "--resume", "--steps", "30", sets=sets) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "training diverged" in last and "its last good checkpoint is step_000002" in last


def test_a_metrics_line_edited_by_hand_is_named_or_drawn_not_a_traceback(prepared, workdir, capsys):
    sets = ("train.checkpoint_interval=2", "train.log_interval=1")
    assert train_cli(prepared, "--name", "hand", "--steps", "2", sets=sets) == 0
    metrics = workdir / "runs" / "hand" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    # text where a figure goes, in the middle: named, nothing trained
    metrics.write_text("".join([lines[0], '{"step": 1, "loss": "abc"}\n', *lines[1:]]))
    capsys.readouterr()
    assert train_cli(prepared, "--name", "hand", "--resume", "--steps", "4", sets=sets) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "metrics.jsonl:2 is not a metrics record; delete that line" in last
    # a record without a rate: the run trains on and draws its plot
    metrics.write_text("".join([*lines, '{"step": 2, "loss": 7.0}\n']))
    assert train_cli(prepared, "--name", "hand", "--resume", "--steps", "4", sets=sets) == 0
    assert (workdir / "runs" / "hand" / "training.png").stat().st_size > 0


def test_a_link_to_nothing_where_a_run_would_go_is_named_as_a_link(prepared, workdir, capsys):
    (workdir / "runs").mkdir()
    (workdir / "runs" / "dang").symlink_to(workdir / "nowhere")
    assert train_cli(prepared, "--name", "dang", "--steps", "1") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "runs/dang is a link to" in last and "pass another --name" in last
    assert not (workdir / "nowhere").exists()


def test_a_name_taken_by_what_is_no_run_is_not_told_to_resume(prepared, workdir, capsys):
    """A bench's folder, runs/bench, was named as a run to resume, which then was refused."""
    (workdir / "runs" / "bench").mkdir(parents=True)
    (workdir / "runs" / "bench" / "soak.json").write_text("{}")
    assert train_cli(prepared, "--name", "bench", "--steps", "1") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: runs/bench already exists and is not a gpuflow run; pass another --name"


def test_sample_refuses_nan_weights_and_takes_the_best_checkpoint_by_default(
    prepared, workdir, capsys
):
    sets = ("train.eval_interval=2",)
    assert train_cli(prepared, "--name", "smp", "--steps", "4", sets=sets) == 0
    latest = ckpt.latest_checkpoint(workdir / "runs" / "smp")
    weights = ckpt.read_checkpoint(latest).weights
    weights["ln_f.weight"][0] = math.nan
    from safetensors.torch import save_file

    model_file = latest / "model.safetensors"
    # New files, not rewrites: best shares the step's files (hard links) when it is that step
    model_file.unlink()
    save_file(weights, str(model_file))
    record = json.loads((latest / "state.json").read_text())  # ours now: recorded as gpuflow does
    record["files"]["model.safetensors"] = {
        "bytes": model_file.stat().st_size, "sha256": ckpt.file_digest(model_file)
    }  # fmt: skip
    record[ckpt.RECORD_DIGEST] = ckpt.record_digest(record)
    (latest / "state.json").unlink()
    (latest / "state.json").write_text(json.dumps(record))
    capsys.readouterr()
    base = ["sample", "--run", "runs/smp", "--max-tokens", "5", "--device", "cpu"]
    assert main([*base, "--checkpoint", "latest"]) == 2
    err = capsys.readouterr().err
    assert "holds NaN or infinite weights (ln_f.weight): the run diverged" in err
    assert main(base) == 0  # the best checkpoint is another folder, and whole


def test_a_run_that_rereads_its_tokens_many_times_is_told(prepared, workdir):
    said: list[str] = []
    for steps in (10, 20000):  # 256 tokens a step over a corpus of about 150,000
        config = resolve_config(
            "tiny", None, [*FAST, f"data.dir={prepared}", f"train.steps={steps}"]
        )
        Trainer(config, workdir / "runs" / "many", Device("cpu")).build(False, said.append)
    assert len(said) == 1, said
    assert "steps of 256 tokens read the" in said[0] and "times over" in said[0]
    assert "checkpoints/best" in said[0]
    assert not (workdir / "runs").exists()  # building writes nothing


def test_lr_after_the_schedule_stays_at_its_floor():
    sets = ["train.steps=20", "train.decay_steps=10", "train.warmup_steps=2"]
    config = resolve_config("tiny", None, sets).train
    assert lr_at(9, config) > lr_at(10, config) == lr_at(15, config) == config.lr * 0.1


def test_a_model_too_large_for_host_memory_is_one_line(prepared, workdir, monkeypatch, capsys):
    def refused(self, *args, **kwargs):  # what the host's allocator raises (no real 25 GB)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 25600000000 bytes")  # fmt: skip

    monkeypatch.setattr("gpuflow.train.setup.GPT.__init__", refused)
    assert train_cli(prepared, "--name", "huge", "--steps", "2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit in host memory" in err, err
    assert not (workdir / "runs" / "huge").exists()


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_sample_refuses_a_temperature_that_is_not_a_number_to_sample_at(
    prepared, workdir, capsys, temperature
):
    assert train_cli(prepared, "--name", "t", "--steps", "2") == 0
    capsys.readouterr()
    args = ["sample", "--run", "runs/t", "--temperature", temperature, "--device", "cpu"]
    assert main(args) == 2
    assert "--temperature must be a number >= 0" in capsys.readouterr().err
