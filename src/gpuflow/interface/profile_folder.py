"""Where ``gpuflow profile`` writes: a folder of its own, and only files it wrote there.

A profile folder is one whose profile.json carries ``PROFILE_FORMAT`` and the SHA-256 of the
trace.json and timeline.png written with it. A folder is reused only when every file in it is
one of those three, as gpuflow wrote it (or a temporary that a killed profile left); anything
else, a link at one of those names included, is refused in one line and left as it is. The
profiles of a gpuflow before the marker carry nothing that tells their trace from a user's,
so they are refused too, with what to do.

Each file is written as a temporary and renamed into place, in an order that keeps the folder
a profile gpuflow recognises at every step: the old trace and timeline go first, then
profile.json, which records the new ones, then those. One profile writes a folder at a time:
the folder itself is locked (``flock``, as a run folder is) from before the check to after
the last write; the folder is written in place, never swapped, so a lock on it stays valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from gpuflow.common.atomic import write_atomic, write_text_atomic
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.outfolder import listed
from gpuflow.train.runfolder import PROFILE_FILE, lock_holder

PROFILE_FORMAT = "gpuflow-profile-1"
TRACE_FILE = "trace.json"
TIMELINE_FILE = "timeline.png"
OUTPUT_FILES = (TRACE_FILE, TIMELINE_FILE, PROFILE_FILE)
# The files profile.json vouches for by their digest (it cannot hold its own).
DIGESTED = (TRACE_FILE, TIMELINE_FILE)
# gpuflow.common.atomic's temporaries of those files: ".trace.json.tmp-<pid>".
_TEMPORARY = re.compile(rf"\.(?:{'|'.join(map(re.escape, OUTPUT_FILES))})\.tmp-\d+")
# What every profile.json written before the format marker holds; a user's rarely does.
_EARLIER_KEYS = {"ledger", "crosscheck", "metrics", "step_clock"}
_DIR_OPEN = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_CHUNK = 1 << 20


@contextmanager
def profile_folder(out_dir: Path) -> Iterator[None]:
    """``out_dir`` made if missing, locked and checked (``check_output_folder``) for the
    block; made here and still empty when the block fails, it is removed again, so that a
    profile that failed leaves nothing behind."""
    check_output_folder(out_dir)  # before making anything: a refused --out stays as it was
    created = _make(out_dir)
    fd = _lock(out_dir)
    try:
        check_output_folder(out_dir)  # again, under the lock: a profile may have just ended
        _remove_temporaries(out_dir)
        yield
    except BaseException:
        if created:
            with suppress(OSError):  # not empty: someone put a file there; it stays
                out_dir.rmdir()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock


def check_output_folder(out_dir: Path) -> None:
    """Refuse, in one line, an ``--out`` that is not new, empty or a profile gpuflow wrote."""
    if out_dir.is_symlink():  # its files would be written through it, into another folder
        raise GpuflowError(
            f"{out_dir} is a link to {os.readlink(out_dir)}; gpuflow writes only into a folder "
            "itself: pass --out the folder it points to, or a new one"
        )
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise GpuflowError(f"{out_dir} is a file; pass --out a folder for the profile")
    entries = sorted(out_dir.iterdir())
    unknown = [_shown(p) for p in entries if not _is_own(p)]
    in_the_way = [p.name for p in entries if p.name in OUTPUT_FILES and not _regular_file(p)]
    if in_the_way:  # a link or a folder where profile writes a file: never written through
        raise GpuflowError(
            f"{out_dir} holds {listed(in_the_way)}, which is a link or not a regular file, "
            "where gpuflow profile writes a file of its own: it is left as it is; move it out, "
            "or pass --out a new or empty folder"
        )
    outputs = [p.name for p in entries if p.name in OUTPUT_FILES]
    if not outputs and not unknown:
        return  # empty, or what a killed profile left: temporaries only
    record = _own_record(out_dir)
    if record is None:
        raise GpuflowError(
            f"{out_dir} exists and is not a gpuflow profile folder: gpuflow did not write "
            f"{listed(outputs + unknown)} (a gpuflow profile's profile.json records format "
            f"{PROFILE_FORMAT}); pass --out a new or empty folder, or move those out"
        )
    if unknown:
        raise GpuflowError(
            f"{out_dir} is a gpuflow profile folder but also holds files gpuflow did not write "
            f"({listed(unknown)}); move them out, or pass --out a new or empty folder"
        )
    changed = [n for n in DIGESTED if n in outputs and _file_digest(out_dir / n) != record.get(n)]
    if changed:
        raise GpuflowError(
            f"{out_dir} is a gpuflow profile folder, but {listed(changed)} in it is not the file "
            "gpuflow wrote there (changed or replaced since): it is left as it is; move it out, "
            "or pass --out a new or empty folder"
        )


def write_profile(
    out_dir: Path, record: dict[str, Any], trace: Path, timeline: bytes | None
) -> dict[str, Any]:
    """Put ``record`` (as profile.json), the trace at ``trace`` and the ``timeline`` PNG (None:
    there is none, and an earlier one is removed) into ``out_dir``, held by ``profile_folder``.
    Returns the record as written, with the digests of the files it vouches for."""
    check_output_folder(out_dir)  # again: files may have come in while the steps ran
    digests = {TRACE_FILE: _file_digest(trace)}
    if timeline is not None:
        digests[TIMELINE_FILE] = _digest([timeline])
    # Checked just now as gpuflow's, they go before profile.json stops vouching for them; a
    # timeline from an accelerator would mislead beside a cpu profile.
    for name in DIGESTED:
        (out_dir / name).unlink(missing_ok=True)
    written = {"format": PROFILE_FORMAT, **record, "files": digests}
    write_text_atomic(out_dir / PROFILE_FILE, json.dumps(written, indent=2) + "\n")
    write_atomic(out_dir / TRACE_FILE, _chunks(trace))
    if timeline is not None:
        write_atomic(out_dir / TIMELINE_FILE, [timeline])
    return written


def _own_record(out_dir: Path) -> dict[str, str] | None:
    """The digests that ``out_dir``'s profile.json records, where gpuflow wrote it; None
    where there is none of gpuflow's. One of an earlier gpuflow is refused here."""
    try:
        record = json.loads((out_dir / PROFILE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, unreadable or not JSON: not ours
        return None
    if not isinstance(record, dict):
        return None
    if "format" not in record and record.keys() >= _EARLIER_KEYS:
        raise GpuflowError(
            f"{out_dir} holds a profile of an earlier gpuflow, whose files cannot be told from "
            f"files of your own (its profile.json has no format {PROFILE_FORMAT}); move or "
            "remove that folder yourself, or pass --out a new or empty folder"
        )
    files = record.get("files")
    if record.get("format") != PROFILE_FORMAT or not isinstance(files, dict):
        return None
    return {name: str(files[name]) for name in DIGESTED if name in files}


def _make(out_dir: Path) -> bool:
    """Make ``out_dir`` (and its parents); whether this call made it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        out_dir.mkdir()
    except FileExistsError:
        return False
    return True


def _lock(out_dir: Path) -> int | None:
    """A descriptor of ``out_dir`` holding an advisory lock on it; refused at once, naming
    the holder, while another profile holds it."""
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform: the folder goes unguarded
        return None
    fd = os.open(out_dir, _DIR_OPEN)  # O_NOFOLLOW: a link put there meanwhile is refused
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_holder(out_dir)
        raise GpuflowError(
            f"{out_dir} is being written by another gpuflow profile"
            + (f" (PID {holder})" if holder is not None else "")
            + "; wait for it to finish, or pass another --out"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_temporaries(out_dir: Path) -> None:
    """Remove the temporaries a killed profile left: under the lock, none is being written."""
    stale = [p for p in out_dir.iterdir() if _TEMPORARY.fullmatch(p.name) and _regular_file(p)]
    for path in stale:
        path.unlink()
    if stale:
        names = ", ".join(p.name for p in stale)
        err_console.print(f"removed what an interrupted profile left in {out_dir}: {names}")


def _is_own(path: Path) -> bool:
    """Whether ``path`` has a name gpuflow profile writes (the content is checked apart)."""
    return path.name in OUTPUT_FILES or (
        bool(_TEMPORARY.fullmatch(path.name)) and _regular_file(path)
    )


def _regular_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _shown(path: Path) -> str:
    return path.name + ("/" if path.is_dir() and not path.is_symlink() else "")


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _digest(chunks: Iterable[bytes]) -> str:
    sha = hashlib.sha256()
    for chunk in chunks:
        sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


def _file_digest(path: Path) -> str:
    return _digest(_chunks(path))
