"""An interrupted ``prepare`` and the run that continues it: what its staging folder records
(``State``, in ``progress.json`` at every finished shard), what the output depends on
(``fingerprint_of``), and taking over the staging folder of a stopped run of the same command
(``take_over``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.common.atomic import write_text_atomic
from gpuflow.data.prepare.outfolder import note, pid_is_running
from gpuflow.data.prepare.pieces import PIECE_CHARS

if TYPE_CHECKING:
    from gpuflow.data.prepare.appending import AppendTarget
    from gpuflow.data.prepare.corpus import Corpus

PROGRESS_FILE = "progress.json"


@dataclass
class State:
    """Where the encoding stands: written to ``progress.json`` at every finished shard."""

    fingerprint: str
    pieces: int = 0
    documents: int = 0
    max_token: int = -1
    forced_cuts: int = 0
    train_shards: int = 0
    train_tokens: int = 0
    val_shards: int = 0
    val_tokens: int = 0

    def save(self, stage: Path) -> None:
        write_text_atomic(stage / PROGRESS_FILE, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, stage: Path) -> State | None:
        try:
            return cls(**json.loads((stage / PROGRESS_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def fingerprint_of(
    settings: dict[str, Any], corpus: Corpus, target: AppendTarget | None
) -> str | None:
    """What the output depends on (``settings``: the run's ``PrepareConfig`` as a dict); None
    where the corpus cannot be read again (stdin)."""
    if not corpus.rereadable:
        return None
    given = settings["tokenizer"]
    if given and Path(given).exists():
        path = Path(given) / "tokenizer.json" if Path(given).is_dir() else Path(given)
        if path.is_file():  # (one that is not is refused, in words, where it is loaded)
            given = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {
        "inputs": corpus.identity(),
        "tokenizer": given,
        "appending_to": target.meta if target else None,
        "piece_chars": PIECE_CHARS,
        **{k: v for k, v in settings.items() if k not in ("force", "workers", "tokenizer")},
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def take_over(out_dir: Path, stage: Path, fingerprint: str) -> State | None:
    """Take over the staging folder of an interrupted run of the same command, if any."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.staging-(\d+)")
    if not out_dir.parent.is_dir():
        return None
    for entry in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or pid_is_running(int(match[1])):
            continue
        state = State.load(entry)
        if state is None or state.fingerprint != fingerprint:
            continue
        os.replace(entry, stage)
        for temporary in stage.glob(".*.tmp-*"):  # the shards that were open when it stopped
            temporary.unlink()
        note(
            f"continuing the interrupted prepare of {out_dir} after its "
            f"{state.train_shards + state.val_shards} finished shards"
        )
        return state
    return None
