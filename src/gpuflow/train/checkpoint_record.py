"""A checkpoint's record (``state.json``): its format, its checksums, and the checks it
passes before any of its fields, or any file it names, is used.

Format 2, written by this version with ``"format": 2``, records the size and SHA-256 of each
file and the record's own SHA-256 (``state_sha256``). Checkpoints written with checksums
before the marker existed carry the same fields and verify the same way. Format 1, written
before checksums, has no marker and records each file's size alone
(``"files": {"model.safetensors": 123456, ...}``); it still loads, checked on those sizes
(CHANGELOG: "Checkpoints written before keep loading on their sizes alone"). Any other record
without its checksums is refused: deleting them must not turn a checkpoint into an
unchecked one. The checksums find damage and edits by hand; they are no signature (anyone
who can write ``state.json`` can also write a digest that matches it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.common.errors import GpuflowError

if TYPE_CHECKING:
    from gpuflow.model.gpt import ModelConfig

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
# The model's shape (ModelConfig's fields) the weights were trained as: a config.toml edited
# since is caught by it, where the weights' shapes alone may still fit (another head count).
MODEL_KEY = "model"
FORMAT_KEY = "format"
FORMAT = 2  # what this version writes: see the module docstring
RECORD_DIGEST = "state_sha256"  # state.json's own checksum, inside it
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHOWN = 40  # characters of a bad value a message quotes
_GROUP_NUMBERS = ("lr", "eps", "weight_decay")  # optimizer settings that must be numbers


class CheckpointDamaged(GpuflowError):
    """A checkpoint's files are missing, truncated or unreadable (not a model mismatch)."""


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            digest.update(piece)
    return digest.hexdigest()


def record_digest(record: dict[str, Any]) -> str:
    """The SHA-256 of a state.json record (its own digest left out), in a canonical form."""
    rest = {k: v for k, v in record.items() if k != RECORD_DIGEST}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def read_record(path: Path) -> dict[str, Any]:
    """The record of the checkpoint folder ``path``: its checksum verified first (where its
    format has one), then the type of every field; ``CheckpointDamaged``, in one line naming
    state.json, otherwise. Its files are not read here (``verify_files``)."""
    file = Path(path) / STATE_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"checkpoint {path} has no readable {STATE_FILE} ({exc})") from None
    if not isinstance(record, dict):
        raise CheckpointDamaged(f"{file} is not a checkpoint's record (a JSON object)")
    version = record_format(record, file)
    if version >= 2 and record[RECORD_DIGEST] != record_digest(record):
        raise CheckpointDamaged(f"{file} was changed after it was written (its checksum differs)")
    _check_fields(record, file, version)
    return record


def record_format(record: dict[str, Any], file: Path) -> int:
    """The format of ``record`` (see the module docstring), refusing one that lacks the
    checksums its format carries."""
    marker = record.get(FORMAT_KEY)
    if FORMAT_KEY in record and marker != FORMAT:
        newer = _is_int(marker) and marker > FORMAT
        raise CheckpointDamaged(
            f"{file} has format {_shown(marker)}, which this gpuflow does not read"
            + ("; it was written by a newer gpuflow: upgrade gpuflow to read it" if newer else "")
        )
    if marker == FORMAT or RECORD_DIGEST in record:
        if not isinstance(record.get(RECORD_DIGEST), str):
            raise CheckpointDamaged(
                f"{file} has no checksum ({RECORD_DIGEST}), which its format always carries: "
                "it was edited after it was written, so its checkpoint is not trusted"
            )
        return FORMAT
    if _sizes_only(record.get("files")):
        return 1  # written before checksums: its files are checked on their sizes
    raise CheckpointDamaged(
        f"{file} has no checksums ({RECORD_DIGEST} and its files' sha256), which every "
        "checkpoint since format 2 carries, and is not an older checkpoint's record (the "
        "sizes of its files): it was edited after it was written, so its checkpoint is not "
        "trusted"
    )


def verify_files(path: Path, record: dict[str, Any], names: Iterable[str]) -> None:
    """Check the files ``names`` of the checkpoint folder ``path`` against ``record`` (from
    ``read_record``): each a regular file, not a link, of the size written and, where the
    record has one, of the SHA-256 written."""
    for filename in names:
        written = record["files"][filename]  # format 1: a size; 2: a size and a digest
        if _is_int(written):
            size, digest = written, None
        else:
            size, digest = written["bytes"], written["sha256"]
        file = Path(path) / filename
        found = file.stat().st_size if file.is_file() and not file.is_symlink() else None
        if found != size:
            state = "missing" if found is None else f"{found:,} bytes where {size:,} were written"
            raise CheckpointDamaged(f"checkpoint file {file} is {state}: it is damaged")
        if digest is not None and file_digest(file) != digest:
            raise CheckpointDamaged(
                f"checkpoint file {file} is not the bytes written (its checksum differs): it "
                "is damaged"
            )


def check_model_record(record: dict[str, Any], config: ModelConfig, path: Path) -> None:
    """Refuse a run config whose model is not the one checkpoint ``path`` was trained as
    (its config.toml edited since): with another head count, say, the weights still load and
    the model computes something else. Checkpoints from before the shape was recorded pass."""
    saved = record.get(MODEL_KEY)
    if saved is None:
        return
    now = asdict(config)
    changed = [f"{k} {now.get(k)} (trained with {v})" for k, v in saved.items() if now.get(k) != v]
    if changed:
        raise GpuflowError(
            f"the run's config gives model {', '.join(changed)}, but checkpoint {path} was "
            "trained as the other; put the run's config.toml back as it was trained"
        )


# ---- the fields, checked once the checksum holds ----------------------------------------------


def _check_fields(record: dict[str, Any], file: Path, version: int) -> None:
    """Refuse a field of the wrong kind in one line: a record that verifies may still come
    from a writer that was not gpuflow's."""
    files_ok = _sizes_only if version == 1 else _digests
    checks: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
        # field: (whether a value is good, what it must be, whether the field is required)
        "step": (lambda v: _is_int(v) and v >= 0, "a step number", True),
        "files": (files_ok, "the size and checksum of each file", True),
        "param_groups": (_param_groups, "a list of optimizer settings", True),
        "rng": (_rng, "base64 random states", False),  # (a run's: a resume requires it)
        "data": (lambda v: isinstance(v, dict), "a data position (an object)", False),
        "tokens_seen": (lambda v: _is_int(v) and v >= 0, "a count of tokens", False),
        "val_loss": (lambda v: v is None or _is_number(v), "a number or null", False),
        "interval": (_interval, "the steps and means of a logging interval's part", False),
        MODEL_KEY: (_model_shape, "the model's shape (positive whole numbers by name)", False),
    }
    for key, (good, what, required) in checks.items():
        if key not in record and not required:
            continue
        if key not in record or not good(record[key]):
            value = f"is {_shown(record[key])}" if key in record else "is missing"
            raise CheckpointDamaged(
                f"{file}: its {key} {value}, not {what}; the checkpoint is damaged"
            )


def _model_shape(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_int(v) and v > 0 for v in value.values())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _sizes_only(files: Any) -> bool:
    """Format 1's ``files``: the size of the model's and the optimizer's file."""
    return isinstance(files, dict) and all(
        _is_int(files.get(name)) and files[name] >= 0 for name in (MODEL_FILE, OPTIMIZER_FILE)
    )


def _digests(files: Any) -> bool:
    """Format 2's ``files``: the size and SHA-256 of the model's and the optimizer's file."""

    def good(entry: Any) -> bool:
        return (
            isinstance(entry, dict)
            and _is_int(entry.get("bytes"))
            and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"]) is not None
        )

    return isinstance(files, dict) and all(good(files.get(n)) for n in (MODEL_FILE, OPTIMIZER_FILE))


def _interval(part: Any) -> bool:
    """The part of a logging interval a checkpoint came inside (``IntervalPart``): the step it
    reaches, how many steps it covers (at least one, none before step 0) and a mean per name."""
    return (
        isinstance(part, dict)
        and _is_int(part.get("through"))
        and _is_int(part.get("steps"))
        and 0 < part["steps"] <= part["through"]
        and isinstance(part.get("means"), dict)
        and all(isinstance(k, str) and _is_number(v) for k, v in part["means"].items())
    )


def _param_groups(groups: Any) -> bool:
    """A list of objects of the optimizer's settings: flags, numbers (``None`` where the
    writer left one out), and ``betas``, two numbers; loading hands them to the optimizer."""

    def good_value(key: str, value: Any) -> bool:
        if key == "betas":
            return isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
        if key in _GROUP_NUMBERS:
            return value is None or _is_number(value)
        return value is None or isinstance(value, (bool, int, float))

    def good(group: Any) -> bool:
        return (
            isinstance(group, dict)
            and "betas" in group
            and all(good_value(k, v) for k, v in group.items())
        )

    return isinstance(groups, list) and all(good(g) for g in groups)


def _rng(rng: Any) -> bool:
    """The host's random state as base64, and the device's (or null)."""
    if not isinstance(rng, dict):
        return False
    return _base64(rng.get("torch")) and (rng.get("device") is None or _base64(rng["device"]))


def _base64(text: Any) -> bool:
    if not isinstance(text, str) or not text:
        return False
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
