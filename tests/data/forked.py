"""gpuflow commands run as real processes, fast enough to kill dozens of them in a test.

Starting ``python -m gpuflow`` costs seconds (the CLI's parser imports torch); ``Forker``
starts one server process that imports the CLI once and forks a child for each command, in
which ``main(argv)`` runs as it does from a shell: its own process, exit status, stdout and
stderr. A child can be stopped by SIGKILL after a delay, or just before its n-th change to the
file system (a file opened for writing, a rename, a link, an unlink, a folder made or removed:
the moments between two of them are every state a kill can leave), or paused there, so that
another command can run while it holds its folder. The server does the killing: a child is
its own unreaped process until then, so a kill never reaches another process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import child_env

SERVER = r"""
import builtins, io, json, os, signal, sys, time, traceback

from gpuflow.interface.cli.main import build_parser, main
import gpuflow.data.prepare.pipeline  # imported before any fork, as every command's module
build_parser()

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def watch(job, record):
    # Count the child's changes to the file system; kill or pause it before the n-th.
    count = [0]
    kill_at, pause_at, pause_s = job.get("kill_at_op"), job.get("pause_at_op"), job.get("pause_s")

    def met(name, path):
        count[0] += 1
        where = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else path
        record.write(f"{count[0]} {name} {where}\n")
        record.flush()
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if count[0] == pause_at:
            time.sleep(pause_s)

    def counted(real, name, test=lambda *a, **k: True):
        def call(*args, **kwargs):
            if test(*args, **kwargs):
                met(name, args[0])
            return real(*args, **kwargs)
        return call

    def writes(file, mode="r", *args, **kwargs):
        return any(c in mode for c in "wax+")

    def os_writes(path, flags, *args, **kwargs):
        return bool(flags & WRITE_FLAGS)

    builtins.open = io.open = counted(io.open, "open", writes)
    os.open = counted(os.open, "os.open", os_writes)
    for name in ("replace", "rename", "link", "unlink", "rmdir", "mkdir"):
        setattr(os, name, counted(getattr(os, name), name))


def child(job):
    os.chdir(job["cwd"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    record = open(job["log"] + ".ops", "w")
    code = 70
    try:
        watch(job, record)
        code = main(job["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid, kill_after):
    deadline = None if kill_after is None else time.monotonic() + kill_after
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)  # our own child, not reaped yet: no other process
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.0005)


for line in sys.stdin:
    job = json.loads(line)
    if job["do"] == "start":
        pid = os.fork()
        if pid == 0:
            child(job)
        reply = {"pid": pid}
    else:
        reply = {"status": wait(job["pid"], job.get("kill_after"))}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


@dataclass
class Ended:
    """How a forked command ended."""

    pid: int
    status: int  # its exit status; -9: killed
    output: str  # its stdout and stderr, as they came
    ops: list[str]  # its changes to the file system (the last: the one it was killed before)
    seconds: float  # from its start to its end, as the test saw them

    @property
    def errors(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("error:")]


class Forker:
    """The server (see the module docstring); a context manager."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder  # where the commands' logs go
        self.folder.mkdir(parents=True, exist_ok=True)
        self.runs = 0
        self._started: dict[int, float] = {}
        env = child_env({"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200"})
        self._server = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True,
        )  # fmt: skip

    def __enter__(self) -> Forker:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server.stdin is not None
        self._server.stdin.close()
        self._server.wait(timeout=60)

    def _ask(self, request: dict) -> dict:
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        assert reply, f"the fork server ended (exit status {self._server.poll()})"
        return json.loads(reply)

    def start(self, argv: list[str], cwd: Path, **hooks: float | None) -> tuple[int, Path]:
        """Start ``gpuflow ARGV`` in ``cwd``; its pid and log. ``hooks``: ``kill_at_op``,
        ``pause_at_op`` with ``pause_s``."""
        self.runs += 1
        log = self.folder / f"run{self.runs:03d}.log"
        job = {"do": "start", "argv": argv, "cwd": str(cwd), "log": str(log), **hooks}
        pid = self._ask(job)["pid"]
        self._started[pid] = time.monotonic()
        return pid, log

    def wait(self, pid: int, log: Path, kill_after: float | None = None) -> Ended:
        """Wait for ``pid`` to end, killing it after ``kill_after`` seconds."""
        status = self._ask({"do": "wait", "pid": pid, "kill_after": kill_after})["status"]
        ops = Path(f"{log}.ops").read_text(errors="replace").splitlines()
        seconds = time.monotonic() - self._started.pop(pid)
        return Ended(pid, status, log.read_text(errors="replace"), ops, seconds)

    def run(
        self, argv: list[str], cwd: Path, kill_after: float | None = None, **hooks: float | None
    ) -> Ended:
        pid, log = self.start(argv, cwd, **hooks)
        return self.wait(pid, log, kill_after)
