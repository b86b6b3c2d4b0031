"""Writes that never leave a half-written file: temporary file, fsync, rename, fsync folder."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` to ``path``; readers see either the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
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
