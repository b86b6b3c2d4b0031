"""Every place a command writes, failed in turn with the OS errors a machine gives (a full
disk, a read-only or forbidden folder, a name too long, a busy file, a file where a folder
should be): the command ends with one line that names the path and says what to do, a
non-zero exit, and nothing the user had before is lost.

The faults are injected where Python meets the file system (files opened for writing,
renames, folders made), on every thread; a write site is where gpuflow's code made that
call (its three innermost frames). A clean run lists the sites; then each site's first call
fails, once per site, the errors taken in turn."""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuflow.data.prepare import outfolder
from gpuflow.interface.cli.main import main
from gpuflow.train.runfolder import read_metrics
from tests.helpers import FAST

WRITE_ERRORS = (
    errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EBUSY, errno.ENAMETOOLONG, errno.ENOTDIR,
)  # fmt: skip
ADVICE = {  # what each error's line must tell the user (gpuflow.common.oserrors)
    errno.ENOSPC: "free disk space",
    errno.EROFS: "choose a writable place",
    errno.EACCES: "permissions",
    errno.EBUSY: "something else holds it",
    errno.ENAMETOOLONG: "shorter",
    errno.ENOTDIR: "a file stands where a folder should be",
}
SOURCE = str(Path(__import__("gpuflow").__file__).parent)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class WriteFaults:
    """Counts writes by site, and fails the first call at ``fail_at`` (a site) with
    ``error`` (an errno)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sites: list[str] = []  # in the order first met
        self.fail_at: str | None = None
        self.error = errno.ENOSPC
        self.failed: str | None = None  # the path of the failed call
        self._lock = threading.Lock()
        real_open, real_os_open = builtins.open, os.open

        def opened(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                self._meet(file)
            return real_open(file, mode, *args, **kwargs)

        def os_opened(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS:
                self._meet(path)
            return real_os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", opened)
        monkeypatch.setattr(io, "open", opened)
        monkeypatch.setattr(os, "open", os_opened)
        for name in ("replace", "rename", "mkdir"):
            monkeypatch.setattr(os, name, self._watched(getattr(os, name), name == "mkdir"))
        # the one rename made through libc: a token folder swapped with its replacement
        exchanged = outfolder._exchanged
        monkeypatch.setattr(outfolder, "_exchanged", lambda a, b: self._met(b) or exchanged(a, b))

    def _watched(self, real: Callable, makes_folder: bool) -> Callable:
        def call(path, *args, **kwargs):
            if not (makes_folder and os.path.exists(path)):  # (that fails as EEXIST first)
                self._meet(path)
            return real(path, *args, **kwargs)

        return call

    def _met(self, path: object) -> None:
        self._meet(path)  # (one frame deeper: _site starts from the caller's caller)

    def _meet(self, path: object) -> None:
        site = _site()
        if site is None:
            return
        with self._lock:
            if site not in self.sites:
                self.sites.append(site)
            if site != self.fail_at or self.failed is not None:
                return
            self.failed = str(path)
        raise OSError(self.error, os.strerror(self.error), str(path))


def _site() -> str | None:
    """Where gpuflow's code made this call: its innermost three frames on this thread's
    stack, as file:line each (so that each caller of a shared helper is a site of its own)."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < 3:
        name = frame.f_code.co_filename
        if name.startswith(SOURCE):
            frames.append(f"{Path(name).relative_to(SOURCE)}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(frames) or None


def _one_line(capsys: pytest.CaptureFixture, error: int, path: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    [line] = lines
    assert ADVICE[error] in line, line
    assert path in line or str(Path(path).parent) in line, (line, path)
    return line


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _restore(saved: Path, folder: Path) -> None:
    shutil.rmtree(folder)
    shutil.copytree(saved, folder)


def test_a_fault_at_any_write_of_a_resumed_run_is_one_line_and_loses_nothing(
    workdir, prepared, monkeypatch, capsys
):  # fmt: skip
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    sets += ["--set", "train.checkpoint_interval=3", "--set", "train.eval_interval=3"]
    train = ["train", "--device", "cpu", "--name", "r", *sets]
    assert main([*train, "--steps", "3"]) == 0
    run = workdir / "runs" / "r"
    saved = workdir / "saved"
    shutil.copytree(run, saved)
    good_metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()

    faults = WriteFaults(monkeypatch)
    assert main([*train, "--steps", "9", "--resume"]) == 0
    sites = list(faults.sites)
    assert len(sites) >= 5, sites  # checkpoints, metrics, report, config at the least
    capsys.readouterr()

    for n, site in enumerate(sites):
        _restore(saved, run)
        faults.fail_at, faults.error, faults.failed = site, WRITE_ERRORS[n % 6], None
        code = main([*train, "--steps", "9", "--resume"])
        assert faults.failed is not None, site
        assert code != 0, site
        _one_line(capsys, faults.error, faults.failed)
        # Nothing the run had is lost: its metrics are all still there, and it resumes.
        assert (run / "metrics.jsonl").read_text().startswith(good_metrics), site
        faults.fail_at = None
        code = main([*train, "--steps", "9", "--resume"])
        err = capsys.readouterr().err
        # a fault after the last checkpoint (the report's) leaves a run that is finished
        assert code == 0 or "already finished 9 of 9 steps" in err, (site, err)
        steps = [row["step"] for row in read_metrics(run) if "loss" in row]
        assert steps == sorted(set(steps)) and steps[-1] == 9, (site, steps)
        capsys.readouterr()


def test_a_fault_at_any_write_of_prepare_is_one_line_and_leaves_no_half_folder(
    workdir, small_corpus, monkeypatch, capsys
):  # fmt: skip
    prepare = ["prepare", "--data", str(small_corpus), "--vocab-size", "512"]
    assert main([*prepare, "--out", "tokens"]) == 0
    before = _snapshot(workdir / "tokens")
    capsys.readouterr()

    faults = WriteFaults(monkeypatch)
    met = {}  # the sites a new folder and a rebuilt one meet (the last swap differs)
    for out in ("other", "tokens"):
        faults.sites.clear()
        assert main([*prepare, "--out", out, "--force"]) == 0
        met[out] = list(faults.sites)
    before = _snapshot(workdir / "tokens")  # as rebuilt (meta.json records the time taken)
    sites = list(dict.fromkeys(met["other"] + met["tokens"]))
    assert len(sites) >= 4, sites  # shards, the tokenizer, the manifest, the swap at the least
    # tokenizer.json and meta.json, each written then renamed into place by gpuflow's own
    # writer (the tokenizer library's save failed on a full disk with no OSError)
    atomic = [s for s in sites if re.search(r"common/atomic\.py:\d+ < data/prepare/pipeline", s)]
    assert len(atomic) >= 4, sites
    shutil.rmtree(workdir / "other")
    capsys.readouterr()

    for n, site in enumerate(sites):
        for out in ("other", "tokens"):  # a new folder, and one prepared before
            if site not in met[out]:
                continue
            faults.fail_at, faults.error, faults.failed = site, WRITE_ERRORS[n % 6], None
            args = [*prepare, "--out", out] + (["--force"] if out == "tokens" else [])
            code = main(args)
            assert faults.failed is not None and code != 0, (site, out)
            line = _one_line(capsys, faults.error, faults.failed)
            assert not (workdir / "other").exists(), site  # nothing half-written is left
            assert _snapshot(workdir / "tokens") == before, site  # the old folder is whole
            leftovers = [p.name for p in workdir.iterdir() if p.name not in {"tokens", "runs"}]
            # finished shards may stay to be continued from, when the line says where
            assert all(f"kept in {name}" in line for name in leftovers), (site, line)
            for name in leftovers:
                shutil.rmtree(workdir / name)


def test_a_fault_at_any_write_of_a_new_run_is_one_line_and_the_command_again_finishes_it(
    workdir, prepared, monkeypatch, capsys
):  # fmt: skip
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    sets += ["--set", "train.checkpoint_interval=3", "--set", "train.eval_interval=3"]
    train = ["train", "--device", "cpu", "--steps", "6", *sets]
    faults = WriteFaults(monkeypatch)
    assert main([*train, "--name", "clean"]) == 0
    sites = list(faults.sites)
    capsys.readouterr()

    for n, site in enumerate(sites):
        here = workdir / f"w{n}"  # a fresh folder: the clean run's writes, in its order
        here.mkdir()
        monkeypatch.chdir(here)
        faults.fail_at, faults.error, faults.failed = site, WRITE_ERRORS[n % 6], None
        code = main([*train, "--name", "clean"])
        assert faults.failed is not None and code != 0, site
        line = _one_line(capsys, faults.error, faults.failed)
        faults.fail_at = None
        if "checkpoints are saved" in line:  # the report, at the end: the run is trained
            steps = [r["step"] for r in read_metrics(here / "runs" / "clean") if "loss" in r]
            assert steps[-1] == 6 and "sample --run" in line, (site, line)
            continue
        # The user runs the command again (with --resume where the line says so).
        again = [*train, "--name", "clean"] + (["--resume"] if "--resume" in line else [])
        code = main(again)
        err = capsys.readouterr().err
        assert code == 0 or "already finished 6 of 6 steps" in err, (site, line, err)
        steps = [r["step"] for r in read_metrics(here / "runs" / "clean") if "loss" in r]
        assert steps == sorted(set(steps)) and steps[-1] == 6, (site, steps)
