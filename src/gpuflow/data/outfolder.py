"""Where ``prepare`` writes: its token folders, and only what it wrote in them.

A token folder is one whose meta.json carries ``META_FORMAT``. ``prepare`` replaces one
(``--force``) only when it holds nothing else, never the current folder or a folder of the
user's own; it builds a new one in a hidden staging folder beside it and swaps it in with two
renames, the old one kept until the new one is in place. Work folders that a killed run left
beside the output (``.NAME.staging-PID``, ``.NAME.old-PID``, their process gone) are cleaned
up, and only prepare's own files in them are deleted.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from gpuflow.common.atomic import replace_folder
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError

META_FORMAT = "gpuflow-tokens-1"


def swap_into_place(stage: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with ``stage``; the old folder stays until the new one is there."""
    retired = sibling(out_dir, "old", os.getpid())
    replace_folder(stage, out_dir, retired)
    if os.path.lexists(retired):
        _remove_own_files(retired)


# ---- what --force may replace ----------------------------------------------------------------

# The files prepare writes into a token folder; anything else in one belongs to someone else.
_OWN_NAME = r"meta\.json|tokenizer\.json|(?:train|val)_\d{6,}\.bin"
_OWN_FILE = re.compile(_OWN_NAME)
# ... and what its staging folders hold besides: temporaries (atomic.py, shards.py) and progress
_OWN_FILE_OR_TEMP = re.compile(rf"{_OWN_NAME}|\.(?:{_OWN_NAME})\.tmp-\d+|progress\.json")


def is_token_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``prepare``: its meta.json carries our format."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def _is_own(entry: Path, pattern: re.Pattern[str] = _OWN_FILE) -> bool:
    return bool(pattern.fullmatch(entry.name)) and entry.is_file() and not entry.is_symlink()


def _foreign_entries(folder: Path) -> list[str]:
    """Names in ``folder`` that prepare did not write, sorted; folders end with ``/``."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not _is_own(p))


def check_replaceable(out_dir: Path, force: bool) -> None:
    """Refuse to write ``out_dir`` unless replacing it loses nothing that prepare did not write."""
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
    foreign = _foreign_entries(out_dir)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise GpuflowError(
            f"{out_dir} is a gpuflow token folder but also holds files gpuflow did not write "
            f"({', '.join(foreign[:5])}{more}); move them out before rebuilding it with "
            "--force, or choose another --out"
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
        foreign = ", ".join(_foreign_entries(folder))
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
            os.replace(entry, out_dir)
            note(f"restored {out_dir} from {entry}, left by an interrupted run")
        elif _remove_own_files(entry):
            note(f"removed {entry}, left by an interrupted run")


def note(text: str) -> None:
    # Paths are printed as they are: no rich markup in them, no line breaks inside them.
    err_console.print(text, markup=False, soft_wrap=True)
