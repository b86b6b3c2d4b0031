"""Where prepare writes: what counts as its token folder, what --force may replace, where an
output may be, its one writer, the swap into place, and the work folders of killed runs
cleaned up or put back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuflow.data.prepare.outfolder as outfolder
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.outfolder import (
    META_FORMAT,
    OutLock,
    check_out_place,
    check_replaceable,
    clean_leftovers,
    is_token_folder,
    lock_path,
    pid_is_running,
    sibling,
    swap_into_place,
)
from tests.helpers import child_env


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


@pytest.mark.parametrize("exchange", [True, False])
def test_the_swap_keeps_the_old_folder_until_the_new_one_is_there(tmp_path, monkeypatch, exchange):
    """With an exchange of names (Linux) the folder is never missing; without one, the old
    folder waits in .out.old-PID between the two renames."""
    out = _token_folder(tmp_path / "out", "train_000000.bin")
    stage = _token_folder(sibling(out, "staging", os.getpid()), "val_000000.bin")
    seen = []
    real_replace = os.replace

    def replacing(source, target):
        seen.append((Path(source).name, Path(target).name, out.exists()))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replacing)
    if not exchange:
        monkeypatch.setattr(outfolder, "_exchanged", lambda first, second: False)
    swap_into_place(stage, out)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "val_000000.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    if exchange and sys.platform == "linux":
        assert seen == []  # one step: no rename leaves the folder missing
    elif not exchange:
        old = f".out.old-{os.getpid()}"
        assert seen == [("out", old, True), (stage.name, "out", False)]


def test_an_output_is_never_the_current_folder_or_a_name_that_is_not_utf8(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_out_place(Path("data") / "books")
    for place in (Path("."), Path(".."), Path("sub/.."), tmp_path, tmp_path.parent):
        with pytest.raises(GpuflowError, match="is the current folder or holds it"):
            check_out_place(place)
    with pytest.raises(GpuflowError, match=r"--out data/d\\xff is not a UTF-8 name"):
        check_out_place(Path("data") / os.fsdecode(b"d\xff"))


HOLDER = """
import sys
from pathlib import Path
from gpuflow.data.prepare.outfolder import OutLock
with OutLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def test_one_writer_at_a_time_and_the_second_is_told_who(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=child_env(), text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        written = lock_path(out).read_bytes()
        assert written == f"{holder.pid}\n".encode()
        with pytest.raises(GpuflowError) as refused:
            OutLock(out).acquire()
        assert str(refused.value) == (
            f"{out} is being written by another gpuflow prepare (process {holder.pid}, which "
            f"holds {lock_path(out)}); wait for it to finish (or give prepare another --out)"
        )
        assert lock_path(out).read_bytes() == written  # the refused one touched nothing
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not lock_path(out).exists()  # removed on release
    with OutLock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_run_given_files_another_run_prepares_waits_for_it(workdir, small_corpus, capsys):
    """Two `train --data` of one corpus at once (a sweep): the second was refused, told to
    give prepare another --out, which train has not."""
    import threading

    from gpuflow.data.prepare.for_training import cache_folder, prepared_for_training

    shutil.copytree(small_corpus / "notes", workdir / "notes")
    folder = cache_folder(512, ("notes",))
    folder.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=child_env(), text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        threading.Timer(1.0, holder.stdin.close).start()  # it ends without a folder made
        assert prepared_for_training(512, ("notes",)) == folder
    finally:
        holder.wait(timeout=60)
    assert f"process {holder.pid} is preparing the same files into {folder}: waiting" in (
        capsys.readouterr().err
    )
    assert is_token_folder(folder)


def test_a_lock_left_by_a_killed_writer_is_taken_over(tmp_path):
    out = tmp_path / "out"
    lock_path(out).write_text(f"{_dead_pid()}\n")  # the kernel let its lock go with it
    with OutLock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert not lock_path(out).exists()


def test_a_lock_file_removed_by_its_holder_is_not_trusted(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder removed it and let go
    gets the lock of a file no longer there: it opens the one there now instead."""
    out = tmp_path / "out"
    first = OutLock(out)
    first.acquire()
    stale = os.open(lock_path(out), os.O_RDWR)  # opened while the holder still held it
    first.release()
    real_open, opened = outfolder._open_lock_file, []

    def opening(path):
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path)

    monkeypatch.setattr(outfolder, "_open_lock_file", opening)
    with OutLock(out):
        assert len(opened) == 2 and lock_path(out).read_text() == f"{os.getpid()}\n"
        with pytest.raises(GpuflowError, match=f"process {os.getpid()}"):
            OutLock(out).acquire()  # held: by this process, through another descriptor


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_lock_file_that_is_no_file_is_left_alone(tmp_path, kind):
    out, target = tmp_path / "out", tmp_path / "target"
    target.write_text("the user's")
    if kind == "link":
        lock_path(out).symlink_to(target)
    else:
        lock_path(out).mkdir()
    with pytest.raises(GpuflowError, match="is not a regular file, where gpuflow keeps the lock"):
        OutLock(out).acquire()
    assert target.read_text() == "the user's"
    assert lock_path(out).is_symlink() == (kind == "link") and os.path.lexists(lock_path(out))


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
    (staging / ".progress.json.tmp-77").write_bytes(b"half")  # killed while writing it
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
