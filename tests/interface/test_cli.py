"""The gpuflow command end to end, as a user runs it from a shell."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gpuflow.data.shards import HEADER_BYTES, Shard, write_shard
from gpuflow.interface.cli.main import main
from gpuflow.train.runfolder import read_metrics
from tests.helpers import FAST, child_env, gpuflow_cli


def test_help_lists_every_command(workdir):
    result = gpuflow_cli("--help", cwd=workdir)
    assert result.returncode == 0
    for command in ("info", "prepare", "train", "sample"):
        assert command in result.stdout


def test_info_json_describes_the_machine(workdir):
    result = gpuflow_cli("info", "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["devices"][-1]["type"] == "cpu"
    assert info["software"]["torch"]
    if info["selected"] == "cpu":
        assert info["data_io"]["path"] == "pinned"
        assert info["link_probe"]["gb_per_s"] == {}
        assert "skipped" in info["link_probe"]["note"]
    else:
        assert set(info["link_probe"]["gb_per_s"]) == {
            "h2d_pinned",
            "h2d_pageable",
            "d2h_pinned",
            "d2h_pageable",
            "d2d",
        }


def test_info_prints_a_readable_summary(workdir):
    result = gpuflow_cli("info", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "devices" in result.stdout and "link probe" in result.stdout
    assert "data.io auto takes " in result.stdout


def test_train_from_nothing_then_sample(workdir):
    """No data prepared: train prepares the built-in corpus, trains, reports; sample reads it."""
    args = (
        "train",
        "--preset",
        "tiny",
        "--steps",
        "12",
        "--set",
        "train.eval_interval=6",
        "--set",
        "train.log_interval=3",
        "--device",
        "cpu",
    )
    result = gpuflow_cli(*args, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "preparing the built-in corpus into data/stdlib-v4096" in result.stderr
    run = workdir / "runs" / "tiny"
    report = json.loads((run / "report.json").read_text())
    assert report["steps_done"] == 12 and report["preset"] == "tiny"
    why = "kvikio reads into CUDA memory, and the device is cpu"
    assert report["data_io"] == {"path": "pinned", "mode": None, "reason": why}
    assert "data.io" not in result.stderr + result.stdout  # a GPU-only choice: not shown
    assert report["final_val_loss"] < report["first_train_loss"]
    assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in read_metrics(run) if "val_loss" in r] == [0, 6, 12]
    assert "finished at step 12" in result.stdout
    assert f"val bpb {report['final_val_bpb']:.4f}" in result.stdout  # built-in: byte-level

    again = gpuflow_cli(*args, cwd=workdir)  # never overwrites: a second run gets a new folder
    assert again.returncode == 0, again.stderr
    assert (workdir / "runs" / "tiny-2" / "report.json").is_file()
    assert json.loads((run / "report.json").read_text()) == report

    sampled = gpuflow_cli(
        "sample",
        "--run",
        "runs/tiny",
        "--prompt",
        "The list",
        "--max-tokens",
        "30",
        "--device",
        "cpu",
        cwd=workdir,
    )
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("The list")
    assert len(sampled.stdout) > len("The list") + 10


def test_prepare_prints_a_summary(workdir, small_corpus):
    result = gpuflow_cli(
        "prepare",
        "--data",
        str(small_corpus),
        "--vocab-size",
        "300",
        "--out",
        "data/mine",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    meta = json.loads((workdir / "data" / "mine" / "meta.json").read_text())
    assert f"{meta['documents']:,} documents" in result.stdout
    assert f"{meta['train_tokens']:,} train" in result.stdout
    assert "tokens/s" in result.stdout


def test_ctrl_c_saves_says_how_to_resume_and_the_resume_finishes_every_step(workdir, prepared):
    sets = [
        a
        for s in (
            *FAST,
            f"data.dir={prepared}",
            "train.log_interval=1",
            "train.eval_interval=1000",
            "train.checkpoint_interval=1000",
        )
        for a in ("--set", s)
    ]
    base = ["-m", "gpuflow", "train", "--steps", "150", "--device", "cpu", *sets]
    env = child_env({"PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(
        [sys.executable, *base, "--name", "cut"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = workdir / "runs" / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 6:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: saved" in err and "--resume" in err
    # The validation loss reported is the last one measured, and says when that was: step 0.
    assert re.search(r"stopped at step \d+: train loss [\d.]+, val loss [\d.]+ at step 0,", out)
    stopped_at = max(r["step"] for r in read_metrics(workdir / "runs" / "cut"))
    assert 5 <= stopped_at < 150

    resumed = gpuflow_cli(*base[2:], "--name", "cut", "--resume", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed runs/cut at step {stopped_at}" in resumed.stderr
    steps = [r["step"] for r in read_metrics(workdir / "runs" / "cut") if "loss" in r]
    assert steps == list(range(1, 151))  # every step once, none lost
    # That the resumed curve is the uninterrupted one, bit for bit: tests/train/test_train.py
    # (resume at a checkpoint) and tests/train/test_crash.py (after SIGINT, SIGTERM, kill -9).


# ---- bad input: one line, exit status 2, nothing half-written -----------------------------


def _bad_shard_folder(folder, damage):
    shard = next(folder.glob("train_*.bin"))
    data = bytearray(shard.read_bytes())
    if damage == "magic":
        data[:4] = (1234).to_bytes(4, "little")
    elif damage == "version":
        data[4:8] = (9).to_bytes(4, "little")
    elif damage == "truncated":
        data = data[: HEADER_BYTES + 100]
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        (None, ["prepare", "--data", "missing.txt"], "corpus path missing.txt does not exist"),
        ("empty", ["prepare", "--data", "empty.txt"], "corpus file empty.txt is empty"),
        ("binary", ["prepare", "--data", "photo.txt"], "photo.txt is not UTF-8 text"),
        ("magic", ["train", "--set", "data.dir=tokens"], "is not a token shard: magic 1234"),
        ("version", ["train", "--set", "data.dir=tokens"], "has version 9 for magic 20240520"),
        ("truncated", ["train", "--set", "data.dir=tokens"], "is truncated"),
        (
            "big-id",
            ["train", "--set", "data.dir=tokens", "--set", "model.vocab_size=600"],
            "holds token id 4000 but model.vocab_size is 600",
        ),
        (None, ["train", "--set", "model.flavour=1"], "unknown key model.flavour"),
        (None, ["train", "--set", "model.n_head=3"], "must be divisible by model.n_head"),
        (None, ["train", "--set", "train.batch_size=-1"], "train.batch_size must be >= 0"),
        (
            None,
            ["train", "--set", "data.dir=tokens", "--set", "model.max_len=40000"],
            "has no run of 40001 tokens",
        ),
        ("toml", ["train", "--config", "run.toml"], "unknown key train.epochs"),
        ("not-a-run", ["sample", "--run", "notes"], "notes is not a gpuflow run"),
        (None, ["sample", "--run", "runs/nothing"], "run folder runs/nothing does not exist"),
        (None, ["train", "--resume"], "there is no run in runs/ to resume"),
        (None, ["train", "--resume", "--preset", "tiny"], "there is no run in runs/ to resume"),
        (None, ["train", "--device", "cuda:7"], "cuda:7"),
        (None, ["train", "--set", "data.io=gds"], "data.io must be one of auto, kvikio, pinned"),
        (None, ["bench", "io", "--device", "cpu"], "bench io reads into CUDA memory"),
        (None, ["bench", "io", "--repeats", "0"], "--mib and --repeats must be >= 1"),
        (
            None,
            ["train", "--set", "data.dir=tokens", "--set", "data.io=kvikio", "--device", "cpu"],
            "data.io=kvikio cannot run: kvikio reads into CUDA memory, and the device is cpu",
        ),
        (
            None,
            [
                "train",
                "--set",
                "data.dir=tokens",
                "--set",
                "data.io=kvikio",
                "--set",
                "train.data_path=standard",
                "--device",
                "cpu",
            ],
            "data.io=kvikio is about the resident corpus; train.data_path 'standard' has none",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workdir, data_copy, capsys, setup, argv, message):
    if setup == "empty":
        (workdir / "empty.txt").write_text("")
    elif setup == "binary":
        (workdir / "photo.txt").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF")
    elif setup in ("magic", "version", "truncated"):
        _bad_shard_folder(data_copy, setup)
    elif setup == "big-id":
        shard = Shard.open(next(data_copy.glob("val_*.bin")))
        tokens = np.array(shard.tokens)
        tokens[0] = 4000
        write_shard(shard.path, tokens)
        (data_copy / "meta.json").unlink()
    elif setup == "toml":
        (workdir / "run.toml").write_text("[train]\nepochs = 3\n")
    elif setup == "not-a-run":
        (workdir / "notes").mkdir()
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    assert main(argv) == 2
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert said.out == ""  # nothing said before the error (no "run folder" line)
    # Nothing was written: no run folder, no data folder, no stray files.
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before


def test_bad_input_from_a_real_process_has_no_traceback(workdir):
    (workdir / "notes").mkdir()
    result = gpuflow_cli("sample", "--run", "notes", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: notes is not a gpuflow run")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_checkpoint_of_another_shape_via_the_cli(workdir, prepared, capsys):
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    assert main(["train", "--steps", "2", "--name", "a", "--device", "cpu", *sets]) == 0
    capsys.readouterr()
    config_before = (workdir / "runs" / "a" / "config.toml").read_text()
    metrics_before = (workdir / "runs" / "a" / "metrics.jsonl").read_text()
    code = main(["train", "--steps", "4", "--name", "a", "--resume", "--set", "model.n_layer=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "a resumed run keeps its model, and model.n_layer is 2 in the run, 3 here" in err
    assert (workdir / "runs" / "a" / "config.toml").read_text() == config_before
    assert (workdir / "runs" / "a" / "metrics.jsonl").read_text() == metrics_before
    # edited by hand, the config is not the model the checkpoint records
    edited = config_before.replace("n_layer = 2", "n_layer = 3")
    (workdir / "runs" / "a" / "config.toml").write_text(edited)
    assert main(["train", "--steps", "4", "--name", "a", "--resume"]) == 2
    assert "gives model n_layer 3 (trained with 2), but checkpoint" in capsys.readouterr().err
    assert (workdir / "runs" / "a" / "metrics.jsonl").read_text() == metrics_before


def test_resume_without_a_name_continues_the_most_recent_run(workdir, prepared, capsys):
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    assert main(["train", "--steps", "2", "--name", "older", "--device", "cpu", *sets]) == 0
    assert main(["train", "--steps", "2", "--name", "newer", "--device", "cpu", *sets]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--steps", "3", "--device", "cpu"]) == 0
    assert "resumed runs/newer at step 2" in capsys.readouterr().err
    assert max(r["step"] for r in read_metrics(workdir / "runs" / "newer")) == 3
    assert max(r["step"] for r in read_metrics(workdir / "runs" / "older")) == 2


def test_an_os_error_any_command_meets_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "runs"))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpuflow.train.runfolder.RunFolder.start", read_only)
    assert main(["train", "--preset", "tiny", "--device", "cpu", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "Read-only file system" in line and str(tmp_path / "runs") in line
    assert "choose a writable place" in line and "Traceback" not in err


@pytest.mark.parametrize(
    "setup,said",
    [("long name", "choose a shorter one"), ("runs is a file", "move it away")],
)
def test_a_run_folder_the_file_system_refuses_is_one_line(workdir, prepared, capsys, setup, said):
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    name = "x" * 300 if setup == "long name" else "r"
    if setup == "runs is a file":
        (workdir / "runs").write_text("not a folder")
    assert main(["train", "--device", "cpu", "--steps", "1", "--name", name, *sets]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert said in line and "Traceback" not in err
    if setup == "runs is a file":
        assert (workdir / "runs").read_text() == "not a folder"


def test_version_names_the_package_version(capsys):
    import gpuflow

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpuflow {gpuflow.__version__}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["sample", "--run", "r", "--max-new-tokens", "5"],
            "--max-new-tokens: did you mean --max-tokens?",
        ),
        (["prepare", "--vocab_size", "300"], "--vocab_size: did you mean --vocab-size?"),
        (["bench", "prepare", "--mibs=3"], "--mibs: did you mean --mib?"),
        (["train", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["train", "--max_iters", "5"],
         "--max_iters: nanoGPT's max_iters is train.steps (or --steps) here "
         "(--set train.steps=VALUE)"),
        (["train", "--learning_rate=1e-3"],
         "--learning_rate: nanoGPT's learning_rate is train.lr here (--set train.lr=VALUE)"),
        (["train", "--dropout", "0"],
         "--dropout: nanoGPT's dropout has no counterpart here: the model has no dropout"),
        (["train", "--n_layer=4"],  # nanoGPT's name, and ours: only not an option
         "--n_layer: a setting here, given as --set model.n_layer=VALUE"),
        (["train", "--compile=False"],
         "--compile: a setting here, given as --set train.compile=VALUE"),
    ],
)  # fmt: skip
def test_an_unknown_option_names_the_one_meant_where_one_is_close(argv, said, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert (
        said in err and f"gpuflow {' '.join(a for a in argv[:2] if not a.startswith('-'))}" in err
    )
    assert "did you mean" not in err or "did you mean" in said


def test_train_ends_naming_how_to_sample_and_sample_says_which_checkpoint_it_used(
    workdir, prepared, capsys
):
    sets = [
        a for s in (*FAST, f"data.dir={prepared}", "train.eval_interval=1000") for a in ("--set", s)
    ]
    # (the end of a run evaluates, so it has a best: removed below, as before any evaluation)
    assert main(["train", "--device", "cpu", "--steps", "2", "--name", "s", *sets]) == 0
    assert "sample from it: gpuflow sample --run runs/s" in capsys.readouterr().out
    best = workdir / "runs" / "s" / "checkpoints" / "best"
    shutil.rmtree(best)  # as if no validation pass had run yet
    assert main(["sample", "--run", "runs/s", "--max-tokens", "3", "--device", "cpu"]) == 0
    assert "has no best checkpoint yet (no validation pass): using step_000002" in (
        capsys.readouterr().err
    )
