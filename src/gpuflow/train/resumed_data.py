"""What a resumed run checks of its token folder against its checkpoints.

A run resumes on its folder as it is now. The tokenizer must be the run's (anything else is
refused). The text may have changed (``prepare --append``, or a folder rebuilt from other
text with the same tokenizer): training then goes on over the folder as it is, and says so.
Its validation windows are spread over the whole val split (and come in micro-batches), so a
changed split gives other windows: losses from there on are not compared with the best
checkpoint's, evaluated on the old ones, and the report's best counts only the evaluations
since.

Each checkpoint's data record carries what these checks compare (``record_fields``): the
validation set's digest, the step after which evaluations used it, the train split's token
count, and the digest of the tokenizer the weights were trained with, which every command
that reads a checkpoint compares with the run's tokenizer.json
(``check_checkpoint_tokenizer``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokens import TokenFolder
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.runfolder import TOKENIZER_FILE


def validation_digest(windows: Sequence[np.ndarray]) -> str:
    """A short digest of the validation windows' token ids (whatever their dtype)."""
    digest = hashlib.sha256()
    for window in windows:  # (B, T+1) each
        digest.update(np.ascontiguousarray(window, dtype=np.int64).tobytes())
        digest.update(repr(window.shape).encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Comparable:
    """Which validation losses compare with the ones to come: those after step ``since``
    (None: all of the run's), against ``best_val`` (inf: none yet)."""

    best_val: float
    since: int | None


def record_fields(
    val_set: str | None, since: int | None, train_tokens: int, tokenizer: str | None
) -> dict[str, Any]:
    """What a checkpoint's data record keeps for the next resume (and ``sample``) to compare;
    ``tokenizer``: ``tokenizer_digest`` of the run's."""
    fields: dict[str, Any] = {"train_tokens": train_tokens}
    if tokenizer is not None:
        fields["tokenizer_sha256"] = tokenizer
    if val_set is not None:
        fields["val_set"] = val_set
    if since is not None:
        fields["val_since"] = since
    return fields


def tokenizer_digest(path: Path) -> str | None:
    """The SHA-256 of the tokenizer.json at ``path`` (None where there is none)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def check_checkpoint_tokenizer(run_dir: Path, checkpoint: Path, data_record: Any) -> None:
    """Refuse a checkpoint trained with another tokenizer than the run's tokenizer.json (one
    copied from another run, or a tokenizer.json replaced since): its ids would be read as
    other text. Checkpoints written before the digest was recorded are not checked."""
    recorded = data_record.get("tokenizer_sha256") if isinstance(data_record, dict) else None
    kept = run_dir / TOKENIZER_FILE
    if recorded is not None and tokenizer_digest(kept) != recorded:
        raise GpuflowError(
            f"{checkpoint} was trained with another tokenizer than {kept} (a checkpoint copied "
            "from another run, or a tokenizer.json replaced since); put back the run's own "
            "tokenizer.json, or use the checkpoint in the run it came from"
        )


def check_tokenizer(run_dir: Path, data: TokenFolder, say: Callable[[str], None]) -> None:
    """A resumed run must read text of its own tokenizer."""
    kept = run_dir / TOKENIZER_FILE
    current = data.tokenizer_path
    if kept.is_file() and current is not None and kept.read_bytes() != current.read_bytes():
        raise GpuflowError(
            f"{current} is not the tokenizer {run_dir} was trained with ({kept}); "
            "point data.dir at the run's data, or start a new run"
        )
    if kept.is_file() and current is None:
        say(f"{data.path} has no tokenizer.json: cannot check it is the run's data")


def compare_with_checkpoints(
    run_dir: Path, resumed: dict[str, Any], step: int, best_val: float, val_set: str,
    data: TokenFolder, say: Callable[[str], None],
) -> Comparable:  # fmt: skip
    """Say what changed in ``data`` since the checkpoint of ``step`` (its data record
    ``resumed``), and which validation losses compare with this run's from here: a best
    checkpoint evaluated on another validation set is not beaten by comparing with it.
    Checkpoints written before these fields were recorded compare as before."""
    since = resumed.get("val_since")
    then = resumed.get("train_tokens")
    if then is not None and then != data.train_tokens:
        say(
            f"note: {data.path} changed since step {step}: its train split holds "
            f"{data.train_tokens:,} tokens where it held {then:,}; training goes on over the "
            "folder as it is now"
        )
    said = []
    if resumed.get("val_set", val_set) != val_set:
        since = step
        said.append(
            f"the validation windows differ from step {step}'s (the folder's val split, or "
            "the step's batch or train.eval_batches, which size them, changed): losses from "
            "here are on other text"
        )
    best = ckpt.best_checkpoint(run_dir)
    best_set = _val_set_of(best) if best is not None else None
    if best_set is not None and best_set != val_set and math.isfinite(best_val):
        said.append(
            f"checkpoints/best (validation loss {best_val:.4f}) was evaluated on other windows "
            "and is not compared with this run's losses: the next evaluation replaces it"
        )
        best_val = math.inf
    if said:
        say("note: " + "; ".join(said))
    return Comparable(best_val, since)


def _val_set_of(checkpoint: Path) -> str | None:
    try:
        return ckpt.read_record(checkpoint).get("data", {}).get("val_set")
    except ckpt.CheckpointDamaged:  # its loss is not trusted either (best_val_loss said)
        return None
