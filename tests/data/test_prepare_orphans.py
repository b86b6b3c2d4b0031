"""prepare's child processes (the tokenizer's trainer, the encoding workers) end with it: a
``gpuflow prepare`` killed outright left them to init, blocked on their pipes for good; and
SIGTERM stops it as Ctrl-C does, in words."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuflow.data.prepare.corpus import default_corpus
from tests.helpers import child_env

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc"
)


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 24 MB of the built-in documents: a few seconds of encoding on two workers."""
    folder = tmp_path_factory.mktemp("orphans")
    text = "\n\n".join(d.text for d in default_corpus())
    with open(folder / "big.txt", "w") as f:
        while f.tell() < 24_000_000:
            f.write(text)
    return folder / "big.txt"


def start(corpus: Path, work: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuflow", "prepare", "--data", str(corpus), "--out", "o",
         "--vocab-size", "300", "--workers", "2", "--tokenizer-sample-mb", "2",
         "--shard-tokens", "1000000"],
        cwd=work, env=child_env({"PYTHONUNBUFFERED": "1"}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_children(process: subprocess.Popen, count: int) -> set[int]:
    """The command's children once it has ``count`` or more of them besides the resource
    tracker's (the encoding workers)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = children(process.pid)
        working = {c for c in found if "resource_tracker" not in _cmdline(c)}
        if len(working) >= count:
            return found
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError("prepare never started its workers")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def gone(pids: set[int], within: float = 15.0) -> set[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


def test_the_encoding_workers_end_when_prepare_is_killed(corpus, tmp_path):
    process = start(corpus, tmp_path)
    kids = wait_for_children(process, 2)
    process.kill()
    process.wait()
    try:
        assert gone(kids) == set()
    finally:
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_prepare_as_ctrl_c_does(corpus, tmp_path):
    process = start(corpus, tmp_path)
    kids = wait_for_children(process, 2)
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted" in err
    assert gone(kids) == set()
    assert not (tmp_path / "o").exists()


ORPHAN = """
import multiprocessing, os, sys, time
from gpuflow.common.orphans import exit_with_parent

def child(parent):
    exit_with_parent(parent)
    time.sleep(120)  # as a trainer busy in its library would

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),))
    p.start()
    print(p.pid, flush=True)
    os._exit(0)  # as SIGKILL ends a process: no clean-up, the child not joined
"""


def test_a_child_told_to_exit_with_its_parent_does_even_when_busy(tmp_path):
    """What the tokenizer's trainer relies on: busy in its library, it reads no pipe."""
    (tmp_path / "orphan.py").write_text(ORPHAN)
    result = subprocess.run(
        [sys.executable, "orphan.py"], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    pid = int(result.stdout.split()[0])
    try:
        assert gone({pid}) == set()
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# prepare, told SIGTERM the moment its ``nth`` child has been started and not yet sent its
# arguments: the child then boots with nothing to read.
SIGTERM_AT_A_START = """
import os, signal, sys
from multiprocessing import util

started = util.spawnv_passfds
spawned = 0

def spawnv_passfds(path, args, passfds):
    global spawned
    pid = started(path, args, passfds)
    if "spawn_main" in str(args):
        spawned += 1
        if spawned == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGTERM)
    return pid

if __name__ == "__main__":
    util.spawnv_passfds = spawnv_passfds
    from gpuflow.interface.cli.main import main
    raise SystemExit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("nth", "sample_mb"), [(1, 10), (1, 2), (2, 2)], ids=["trainer", "worker", "second-worker"]
)
def test_sigterm_as_a_child_starts_stops_prepare_in_words(corpus, tmp_path, nth, sample_mb):
    """A SIGTERM while a child was starting left it to boot with half its arguments, or after
    its files were gone, and each printed a traceback; in the pool's own start, prepare
    itself failed with one. The interrupt now waits for the start to finish."""
    (tmp_path / "stop.py").write_text(SIGTERM_AT_A_START)
    result = subprocess.run(
        [sys.executable, "stop.py", str(nth), "prepare", "--data", str(corpus), "--out", "o",
         "--vocab-size", "300", "--workers", "2", "--tokenizer-sample-mb", str(sample_mb)],
        cwd=tmp_path, env=child_env({"PYTHONUNBUFFERED": "1"}), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    assert "interrupted" in result.stderr
    assert not (tmp_path / "o").exists()
