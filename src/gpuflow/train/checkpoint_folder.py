"""The checkpoints folder of a run, ``runs/<name>/checkpoints/``: which of its entries are
checkpoints gpuflow wrote (a real folder with a real state.json, never a link), which is
the latest and the best, and what a killed writer left there (``Checkpointer`` in
``gpuflow.train.checkpoint`` writes them).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gpuflow.common.atomic import fsync_dir
from gpuflow.common.errors import GpuflowError
from gpuflow.train.checkpoint_record import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    CheckpointDamaged,
    read_record,
)

STEP_PREFIX = "step_"
BEST = "best"
# What the writer leaves behind when killed mid-write: ``.step_000300.tmp-<pid>`` while a
# checkpoint is built, ``.best.old-<pid>`` while a complete one is being replaced,
# ``.step_000100.pruned-<pid>`` while an old one is deleted.
_TEMPORARY = re.compile(rf"^\.({STEP_PREFIX}\d+|{BEST})\.(tmp|old|pruned)-\d+$")


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete ``step_*`` checkpoints, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not real_dir(folder):
        return []
    found = [p for p in folder.iterdir() if is_step_name(p.name) and written_here(p)]
    return sorted(found, key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))


def is_step_name(name: str) -> bool:
    return name.startswith(STEP_PREFIX) and name.removeprefix(STEP_PREFIX).isdigit()


def real_dir(path: Path) -> bool:
    """A folder, not a link to one (gpuflow never follows a link out of a run)."""
    return path.is_dir() and not path.is_symlink()


def written_here(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder this module installed: a real folder whose
    state.json (written last, inside it) is a real file."""
    state = path / STATE_FILE
    return real_dir(path) and state.is_file() and not state.is_symlink()


def foreign_entries(path: Path) -> list[str]:
    """What a checkpoint folder holds that gpuflow did not write there (a note, a file of
    the user's), by name: gpuflow neither deletes nor replaces it."""
    ours = {STATE_FILE, MODEL_FILE, OPTIMIZER_FILE}
    return sorted(name for name in os.listdir(path) if name not in ours)


def _give_back_foreign(temporary: Path, final: Path) -> None:
    """The user's files that a writer killed mid-replace had moved into ``temporary``, put
    back into the checkpoint ``final`` before the temporary is removed."""
    if not written_here(final):
        return
    for name in foreign_entries(temporary):
        if not os.path.lexists(final / name):
            os.replace(temporary / name, final / name)


def check_checkpoint_folder(run_dir: Path) -> None:
    """Refuse, before any work, a run whose ``checkpoints/`` gpuflow could not write into
    without following a link out of the run or replacing what it did not write: a file or a
    link where the folder should be, or a ``step_*``/``best`` entry that is not a complete
    checkpoint of its own."""
    folder = checkpoint_dir(run_dir)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        kind = "a link" if folder.is_symlink() else "a file"
        raise GpuflowError(
            f"{folder} is {kind}, not the run's checkpoint folder; gpuflow writes its "
            "checkpoints there and will not follow or replace it: move it out of the run"
        )
    if not folder.exists():
        return
    for path in sorted(folder.iterdir()):
        if (is_step_name(path.name) or path.name == BEST) and not written_here(path):
            raise GpuflowError(
                f"{path} is not a checkpoint gpuflow wrote (a link, or no {STATE_FILE} in "
                f"it), so it neither reads nor replaces it: move it out of {folder}, or put "
                f"its {STATE_FILE} back"
            )


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def latest_step(run_dir: Path) -> int:
    """The step of the newest checkpoint whose record verifies (the one a resume starts
    from, unless its files are damaged); 0 without one."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return int(read_record(path)["step"])
        except CheckpointDamaged:
            continue
    return 0


def best_checkpoint(run_dir: Path) -> Path | None:
    path = checkpoint_dir(run_dir) / BEST
    return path if real_dir(path.parent) and written_here(path) else None


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Clear what a killed writer left in ``checkpoints/``; returns the names handled.

    Call only while holding the run (``gpuflow.train.runfolder.RunFolder``): then no writer is
    alive. A temporary folder is removed; a complete checkpoint that was moved aside to be
    replaced is put back if its replacement never arrived, else removed.
    """
    folder = checkpoint_dir(run_dir)
    if not real_dir(folder):
        return []
    handled = []
    for path in sorted(folder.iterdir()):
        match = _TEMPORARY.match(path.name)
        if match and real_dir(path):  # a name only this module gives, a folder it made
            final = folder / match.group(1)
            if match.group(2) == "old" and not os.path.lexists(final):
                os.replace(path, final)
            else:
                _give_back_foreign(path, final)
                shutil.rmtree(path)
            handled.append(path.name)
    if handled:
        fsync_dir(folder)
    return handled
