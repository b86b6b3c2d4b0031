"""Where prepare writes: what counts as its token folder, what --force may replace, the swap
into place, and the work folders of killed runs cleaned up or put back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.data.outfolder import (
    META_FORMAT,
    check_replaceable,
    clean_leftovers,
    is_token_folder,
    pid_is_running,
    sibling,
    swap_into_place,
)


def _dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


def _token_folder(path, *files: str):
    """A folder prepare could have written: meta.json of our format and ``files``."""
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"format": META_FORMAT}))
    for name in files:
        (path / name).write_bytes(b"\0" * 8)
    return path


def test_a_prepared_folder_is_a_token_folder_and_others_are_not(prepared, tmp_path):
    assert is_token_folder(prepared)
    assert not is_token_folder(tmp_path)  # no meta.json
    (tmp_path / "meta.json").write_text(json.dumps({"format": "someone-elses"}))
    assert not is_token_folder(tmp_path)
    (tmp_path / "meta.json").write_text("not json")
    assert not is_token_folder(tmp_path)


def test_nothing_there_or_an_empty_folder_may_be_written(tmp_path):
    check_replaceable(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", force=False)


def test_a_token_folder_is_replaced_only_with_force_and_only_when_it_holds_nothing_else(tmp_path):
    out = _token_folder(tmp_path / "out", "tokenizer.json", "train_000000.bin", "val_000000.bin")
    with pytest.raises(GpuflowError, match="pass --force to rebuild it"):
        check_replaceable(out, force=False)
    check_replaceable(out, force=True)
    (out / "notes.txt").write_text("mine")
    (out / "extra").mkdir()
    with pytest.raises(
        GpuflowError, match=r"also holds files gpuflow did not write \(extra/, notes"
    ):
        check_replaceable(out, force=True)


def test_a_folder_of_the_users_own_or_a_file_is_never_replaced(tmp_path, monkeypatch):
    own = tmp_path / "photos"
    own.mkdir()
    (own / "a.jpg").write_bytes(b"jpeg")
    with pytest.raises(GpuflowError, match="--force replaces only those"):
        check_replaceable(own, force=True)
    with pytest.raises(GpuflowError, match="already exists and is not a gpuflow token folder"):
        check_replaceable(own, force=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(GpuflowError, match="is not a gpuflow token folder"):
        check_replaceable(tmp_path / "file", force=True)
    out = _token_folder(tmp_path / "out", "meta.json")
    monkeypatch.chdir(out)
    with pytest.raises(GpuflowError, match="is the current folder or holds it"):
        check_replaceable(out, force=True)


def test_swap_into_place_replaces_the_folder_and_leaves_no_old_one(tmp_path):
    out = _token_folder(tmp_path / "out", "train_000000.bin")
    stage = _token_folder(
        sibling(out, "staging", os.getpid()), "train_000000.bin", "val_000000.bin"
    )
    swap_into_place(stage, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "train_000000.bin",
        "val_000000.bin",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_work_folders_are_named_after_the_output_and_their_process():
    from pathlib import Path

    assert sibling(Path("data/small"), "staging", 42) == Path("data/.small.staging-42")
    assert pid_is_running(os.getpid())
    assert pid_is_running(os.getppid())
    assert not pid_is_running(_dead_pid())


def test_leftovers_of_a_killed_run_are_cleaned_and_only_prepares_own_files_deleted(
    tmp_path, capsys
):
    out = _token_folder(tmp_path / "out", "train_000000.bin")  # the finished output
    dead, alive = _dead_pid(), os.getppid()
    staging = _token_folder(sibling(out, "staging", dead), "train_000000.bin", "progress.json")
    (staging / ".train_000001.bin.tmp-77").write_bytes(b"half")
    kept = _token_folder(sibling(out, "old", dead), "train_000000.bin")
    (kept / "mine.txt").write_text("the user's")
    running = _token_folder(sibling(out, "staging", alive), "train_000000.bin")
    clean_leftovers(out)
    assert not staging.exists()
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]  # only gpuflow's files went
    assert running.exists()  # its process still runs
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train_000000.bin"]
    err = capsys.readouterr().err
    assert f"removed {staging}, left by an interrupted run" in err.replace("\n", "")
    assert "it holds files gpuflow did not write (mine.txt)" in err.replace("\n", "")


def test_a_run_killed_between_its_renames_gets_the_previous_folder_back(tmp_path, capsys):
    out = tmp_path / "out"
    old = _token_folder(sibling(out, "old", _dead_pid()), "train_000000.bin")
    clean_leftovers(out)
    assert is_token_folder(out) and not old.exists()
    assert "restored" in capsys.readouterr().err
    shutil.rmtree(out)
    clean_leftovers(tmp_path / "nowhere" / "out")  # no parent folder: nothing to do
