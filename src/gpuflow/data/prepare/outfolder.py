"""Where ``prepare`` writes: its token folders, and only what it wrote in them.

A token folder is one whose meta.json carries ``META_FORMAT``. ``prepare`` replaces one
(``--force``) only when it holds nothing else, never the current folder or a folder of the
user's own; it builds a new one in a hidden staging folder beside it and swaps it in with two
renames, the old one kept until the new one is in place. Work folders that a killed run left
beside the output (``.NAME.staging-PID``, ``.NAME.old-PID``, their process gone) are cleaned
up, and only prepare's own files in them are deleted.

One process writes a token folder at a time: ``OutLock`` holds an advisory lock on
``.NAME.lock`` beside it for the whole command. The lock file lives beside the folder, not
in it, because the folder itself is replaced by a rename: a lock file inside would be another
file once the new folder is in place, and guard nothing from then on.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
import sys
import time
from contextlib import suppress
from pathlib import Path

from gpuflow.common.atomic import fsync_dir, replace_folder
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError

META_FORMAT = "gpuflow-tokens-1"


def swap_into_place(stage: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with ``stage``: in one step where the system exchanges two names
    at once (Linux), so that ``out_dir`` is never missing; elsewhere by two renames, the old
    folder kept as ``.NAME.old-PID`` until the new one is there (``put_back`` undoes a kill
    between them)."""
    if out_dir.is_dir() and not out_dir.is_symlink() and _exchanged(stage, out_dir):
        fsync_dir(out_dir.parent)
        _remove_own_files(stage)  # now the old folder (left to a kill: cleaned as a staging)
        return
    retired = sibling(out_dir, "old", os.getpid())
    replace_folder(stage, out_dir, retired)
    if os.path.lexists(retired):
        _remove_own_files(retired)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchanged(first: Path, second: Path) -> bool:
    """Swap two names in one rename (``renameat2(RENAME_EXCHANGE)``); False where the
    system or its file system cannot."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28 and later
    if renameat2 is None:
        return False
    paths = (os.fsencode(first), os.fsencode(second))
    if renameat2(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # a kernel or file system without it
    raise OSError(code, os.strerror(code), str(second))


# ---- where --out may be -----------------------------------------------------------------------


def check_out_place(out_dir: Path) -> None:
    """Refuse an ``--out`` that no folder can be swapped into (the current folder or one
    holding it) or whose name is not UTF-8 (a tokenizer file and a training config cannot
    hold it)."""
    try:
        str(out_dir).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(out_dir).decode("utf-8", "backslashreplace")
        raise GpuflowError(
            f"--out {shown} is not a UTF-8 name, which tokenizer files and training configs "
            "cannot hold; choose a name of UTF-8 characters"
        ) from None
    if out_dir.name in ("", ".", "..") or Path.cwd().is_relative_to(out_dir.resolve()):
        raise GpuflowError(f"{out_dir} is the current folder or holds it; choose another --out")


# ---- one writer at a time --------------------------------------------------------------------

_LOCK_OPEN = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)


def lock_path(out_dir: Path) -> Path:
    """The lock file of ``out_dir``: beside it, so that it outlives the folder's swaps."""
    return out_dir.with_name(f".{out_dir.name}.lock")


class FolderBusy(GpuflowError):
    """Another process holds the folder's lock; ``holder`` is its process id, as recorded."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class OutLock:
    """``out_dir``'s one writer: an advisory lock (``flock``) on ``lock_path(out_dir)``, held
    from ``__enter__`` to ``__exit__``. A second writer is refused at once (``FolderBusy``),
    naming the holder's process, which the file records, or with ``wait`` waits for it; the
    file is removed on release."""

    def __init__(self, out_dir: Path, wait: bool = False) -> None:
        self.out_dir = out_dir
        self.path = lock_path(out_dir)
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform: the folder goes unguarded
            return
        while self._fd is None:
            fd = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise FolderBusy(
                    f"{self.out_dir} is being written by another gpuflow prepare (process "
                    f"{holder}, which holds {self.path}); wait for it to finish (or give "
                    "prepare another --out)",
                    holder,
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # its last holder removed it while letting go: lock the one there now
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            with suppress(OSError):  # removed while still held: whoever opened it meanwhile
                os.unlink(self.path)  # finds it gone once it has the lock, and tries again
        finally:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def _open_lock_file(path: Path) -> int:
    try:
        fd = os.open(path, _LOCK_OPEN, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR):  # a link, a folder
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        raise GpuflowError(
            f"{path} is not a regular file, where gpuflow keeps the lock of its output folder: "
            "it is left as it is; remove or move it, then run the command again"
        )
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """The PID the lock's holder wrote into it (it writes it just after locking)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.01)
    return "unknown"


# ---- what --force may replace ----------------------------------------------------------------

# The files prepare writes into a token folder; anything else in one belongs to someone else.
_OWN_NAME = r"meta\.json|tokenizer\.json|(?:train|val)_\d{6,}\.bin"
_OWN_FILE = re.compile(_OWN_NAME)
# ... and what its staging folders hold besides: progress, and the temporaries of each
# (atomic.py, shards.py) that a kill leaves
_STAGE_NAME = rf"{_OWN_NAME}|progress\.json"
_OWN_FILE_OR_TEMP = re.compile(rf"{_STAGE_NAME}|\.(?:{_STAGE_NAME})\.tmp-\d+")


def foreign_entries(folder: Path) -> list[str]:
    """Names in ``folder`` that prepare did not write, sorted; folders end with ``/``."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not _is_own(p))


def listed(names: list[str], most: int = 5) -> str:
    """The first ``most`` of ``names``, and how many more there are."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def is_token_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``prepare``: its meta.json carries our format."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def _is_own(entry: Path, pattern: re.Pattern[str] = _OWN_FILE) -> bool:
    return bool(pattern.fullmatch(entry.name)) and entry.is_file() and not entry.is_symlink()


def check_replaceable(out_dir: Path, force: bool) -> None:
    """Refuse to write ``out_dir`` unless replacing it loses nothing that prepare did not write."""
    if out_dir.is_symlink():  # the new folder is renamed into its place: the link would go
        raise GpuflowError(
            f"{out_dir} is a link to {os.readlink(out_dir)}; pass --out the folder itself"
        )
    if not os.path.lexists(out_dir) or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return  # nothing there, or an empty folder: nothing to lose
    if Path.cwd().is_relative_to(out_dir.resolve()):
        raise GpuflowError(f"{out_dir} is the current folder or holds it; choose another --out")
    if not out_dir.is_dir() or not is_token_folder(out_dir):
        what = f"a gpuflow token folder (it has no meta.json with format {META_FORMAT})"
        if force:
            raise GpuflowError(
                f"{out_dir} is not {what} and --force replaces only those; choose another --out"
            )
        raise GpuflowError(f"{out_dir} already exists and is not {what}; choose another --out")
    foreign = foreign_entries(out_dir)
    if foreign:
        raise GpuflowError(
            f"{out_dir} is a gpuflow token folder but also holds files gpuflow did not write "
            f"({listed(foreign)}); move them out before rebuilding it with --force, or choose "
            "another --out"
        )
    if not force:
        raise GpuflowError(
            f"{out_dir} already exists; pass --force to rebuild it, --append to add to it or "
            "--out to write elsewhere"
        )


def _remove_own_files(folder: Path) -> bool:
    """Delete what prepare wrote in ``folder``, then the folder if that emptied it.

    Returns whether the folder is gone; one holding anything else is kept, with a warning.
    """
    if folder.is_symlink():
        folder.unlink()  # the folder it points at is not ours to empty
        return True
    for entry in folder.iterdir():
        if _is_own(entry, _OWN_FILE_OR_TEMP):
            entry.unlink()
    try:
        folder.rmdir()
    except OSError:
        foreign = ", ".join(foreign_entries(folder))
        note(f"kept {folder}: it holds files gpuflow did not write ({foreign})")
        return False
    return True


# ---- leftovers of interrupted runs ------------------------------------------------------------


def sibling(out_dir: Path, kind: str, pid: int) -> Path:
    """A hidden work folder beside ``out_dir``, named after it and the process that owns it."""
    return out_dir.with_name(f".{out_dir.name}.{kind}-{pid}")


def pid_is_running(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill would end the process
        return True
    try:
        os.kill(pid, 0)  # signal 0: checks that the process exists, sends nothing
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def put_back(out_dir: Path) -> None:
    """A run killed between the two renames of ``swap_into_place`` left no ``out_dir`` and
    the previous one in ``.NAME.old-PID``: put that one back (before anything reads
    ``out_dir``)."""
    if os.path.lexists(out_dir) or not out_dir.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.old-(\d+)")
    for entry in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or pid_is_running(int(match[1])):
            continue
        if is_token_folder(entry):
            os.replace(entry, out_dir)
            note(f"restored {out_dir} from {entry}, left by an interrupted run")
            return


def clean_leftovers(out_dir: Path) -> None:
    """Remove the work folders that runs killed while writing ``out_dir`` left beside it.

    Only ``.NAME.staging-PID`` and ``.NAME.old-PID`` folders whose process is gone are
    touched, and only prepare's own files in them (a staging folder the current run can
    continue from has been taken over before this). A run killed between its two renames
    leaves no ``out_dir`` and the previous one in ``.NAME.old-PID``: that one is put back.
    """
    if not out_dir.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(staging|old)-(\d+)")
    for entry in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or pid_is_running(int(match[2])):
            continue
        if match[1] == "old" and not os.path.lexists(out_dir) and is_token_folder(entry):
            put_back(out_dir)
        elif _remove_own_files(entry):
            note(f"removed {entry}, left by an interrupted run")


def note(text: str) -> None:
    # Paths are printed as they are: no rich markup in them, no line breaks inside them.
    err_console.print(text, markup=False, soft_wrap=True)
