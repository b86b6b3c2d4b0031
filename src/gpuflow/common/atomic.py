"""Writes that never leave a half-written file: temporary file, fsync, rename, fsync folder.

The temporary file is named for the process (``.NAME.tmp-PID``) and created with
``O_EXCL | O_NOFOLLOW``: a file or link planted under that name is never opened, so nothing
is written through it. The final name must be a regular file or absent, checked just before
the rename: a link or anything else there is refused, neither followed nor replaced.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from gpuflow.common.errors import GpuflowError

EXCLUSIVE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def open_new(path: Path, mode: int = 0o644) -> int:
    """A file descriptor of ``path``, created new: refused (one line) where anything, a link
    included, is already there."""
    try:
        return os.open(path, EXCLUSIVE_NEW, mode)
    except FileExistsError:
        raise GpuflowError(
            f"{path} is in the way of a file gpuflow writes (left by another process, or "
            "planted): gpuflow never writes through it; remove it if nothing else is writing"
        ) from None


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(path: Path) -> None:
    """Refuse, in one line, to replace ``path`` unless it is a regular file or absent."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
        kind = "a link" if os.path.islink(path) else "not a regular file"
        raise GpuflowError(
            f"{path} is {kind}, where gpuflow writes a file of its own: it is left as it is; "
            "remove or move it, then run the command again"
        )


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` to ``path``; readers see either the old file or the whole new one."""
    path = Path(path)
    check_replaceable(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = open_new(tmp)  # raises before anything is written: nothing of ours to remove
    try:
        with open(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        check_replaceable(path)  # again: something may have been put there meanwhile
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def replace_folder(new: Path, final: Path, retired: Path) -> None:
    """Put the folder ``new`` where ``final`` is, the old ``final`` (if any) moved to
    ``retired`` first; if the second rename fails, the old one is put back, so ``final`` is
    never left missing. The caller removes ``retired`` once it is done with it."""
    if os.path.lexists(final):
        os.replace(final, retired)
    try:
        os.replace(new, final)
    except OSError:
        if os.path.lexists(retired) and not os.path.lexists(final):
            os.replace(retired, final)
        raise
    fsync_dir(final.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, [text.encode("utf-8")])
