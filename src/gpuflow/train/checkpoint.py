"""Checkpoints: safetensors weights and optimizer moments, JSON trainer state.

    runs/<name>/checkpoints/step_000300/
        model.safetensors       fp32 weights (the tied output head is the token table)
        optimizer.safetensors   AdamW moments and step counts, keyed state.<param>.<name>
        state.json              step, optimizer hyper-parameters, ``RunState`` (random
                                states, data position...), each file's byte size (last)
    runs/<name>/checkpoints/best/   the same, at the step with the lowest validation loss

``Checkpointer.save`` writes while training goes on; ``resumable_checkpoint`` reads the newest
intact one. How saving overlaps training, and what a killed writer leaves:
docs/architecture/training.md (Checkpoints).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpuflow.common.atomic import fsync_dir, replace_folder
from gpuflow.common.errors import GpuflowError
from gpuflow.common.oserrors import describe_os_error
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import check_state_shapes
from gpuflow.transfer.snapshot import Slot, Snapshot, StateSnapshot

STEP_PREFIX = "step_"
BEST = "best"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
RECORD_DIGEST = "state_sha256"  # state.json's own checksum, inside it
# Optimizer flags that describe the machine, not the run: the live optimizer's win on load.
_EXECUTION_FLAGS = ("fused", "foreach", "capturable", "differentiable")
# What this module leaves behind when killed mid-write: ``.step_000300.tmp-<pid>`` while a
# checkpoint is built, ``.best.old-<pid>`` while a complete one is being replaced,
# ``.step_000100.pruned-<pid>`` while an old one is deleted.
_TEMPORARY = re.compile(rf"^\.({STEP_PREFIX}\d+|{BEST})\.(tmp|old|pruned)-\d+$")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointDamaged(GpuflowError):
    """A checkpoint's files are missing, truncated or unreadable (not a model mismatch)."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete ``step_*`` checkpoints, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not _real_dir(folder):
        return []
    found = [p for p in folder.iterdir() if _is_step_name(p.name) and _written_here(p)]
    return sorted(found, key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))


def _is_step_name(name: str) -> bool:
    return name.startswith(STEP_PREFIX) and name.removeprefix(STEP_PREFIX).isdigit()


def _real_dir(path: Path) -> bool:
    """A folder, not a link to one (gpuflow never follows a link out of a run)."""
    return path.is_dir() and not path.is_symlink()


def _written_here(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder this module installed: a real folder whose
    state.json (written last, inside it) is a real file."""
    state = path / STATE_FILE
    return _real_dir(path) and state.is_file() and not state.is_symlink()


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
        if (_is_step_name(path.name) or path.name == BEST) and not _written_here(path):
            raise GpuflowError(
                f"{path} is not a checkpoint gpuflow wrote (a link, or no {STATE_FILE} in "
                f"it), so it can neither resume from it nor replace it: move it out of "
                f"{folder}, or put its {STATE_FILE} back"
            )


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def best_checkpoint(run_dir: Path) -> Path | None:
    path = checkpoint_dir(run_dir) / BEST
    return path if _real_dir(path.parent) and _written_here(path) else None


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Clear what a killed writer left in ``checkpoints/``; returns the names handled.

    Call only while holding the run (``gpuflow.train.runfolder.RunFolder``): then no writer is
    alive. A temporary folder is removed; a complete checkpoint that was moved aside to be
    replaced is put back if its replacement never arrived, else removed.
    """
    folder = checkpoint_dir(run_dir)
    if not _real_dir(folder):
        return []
    handled = []
    for path in sorted(folder.iterdir()):
        match = _TEMPORARY.match(path.name)
        if match and _real_dir(path):  # a name only this module gives, a folder it made
            final = folder / match.group(1)
            if match.group(2) == "old" and not os.path.lexists(final):
                os.replace(path, final)
            else:
                shutil.rmtree(path)
            handled.append(path.name)
    if handled:
        fsync_dir(folder)
    return handled


# ---- what a run records ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunState:
    """What a training run's checkpoint holds beyond weights and optimizer (state.json): the
    random states, the data position (every data path draws step s's batch from (seed, s),
    plus a streamed corpus's place in its chunk order), the tokens trained so far and the
    latest validation loss. The record's layout lives here alone."""

    data: dict[str, Any]
    tokens_seen: int
    val_loss: float | None
    rng_torch: torch.Tensor
    rng_device: torch.Tensor | None

    @classmethod
    def now(
        cls, device: Device, data: dict[str, Any], tokens_seen: int, val_loss: float | None
    ) -> RunState:
        """The run's state after its latest step, random states read now."""
        return cls(data, tokens_seen, val_loss, torch.get_rng_state(), device.rng_state())

    def as_record(self) -> dict[str, Any]:
        rng_device = encode_tensor(self.rng_device) if self.rng_device is not None else None
        return {
            "rng": {"torch": encode_tensor(self.rng_torch), "device": rng_device},
            "data": dict(self.data),
            "tokens_seen": self.tokens_seen,
            "val_loss": self.val_loss,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], tokens_seen: int) -> RunState:
        """The state a checkpoint recorded; ``tokens_seen`` where it predates that field."""
        rng = record["rng"]
        return cls(
            data=dict(record.get("data", {})),
            tokens_seen=int(record.get("tokens_seen", tokens_seen)),
            val_loss=record.get("val_loss"),
            rng_torch=decode_byte_tensor(rng["torch"]),
            rng_device=decode_byte_tensor(rng["device"]) if rng.get("device") else None,
        )

    def restore_rng(self, device: Device) -> None:
        """Put the random states back (the device's where it has one)."""
        torch.set_rng_state(self.rng_torch)
        if self.rng_device is not None and device.rng_state() is not None:
            device.set_rng_state(self.rng_device)


def best_val_loss(run_dir: Path) -> float:
    """The validation loss of the run's best checkpoint: inf if it has none, or a damaged
    one (which only loses its record)."""
    best = best_checkpoint(run_dir)
    if best is None:
        return math.inf
    try:
        value = read_record(best).get("val_loss")
    except GpuflowError:
        return math.inf
    return float(value) if value is not None else math.inf


# ---- writing --------------------------------------------------------------------------------


def encode_tensor(t: torch.Tensor) -> str:
    """Base64 of a host tensor's bytes (RNG states live on the host, even for CUDA)."""
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def decode_byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def checkpoint_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The weights, the optimizer's tensors and its hyper-parameters, as a checkpoint holds
    them. The tensors are the live ones (no copies); nothing here waits for the device."""
    optim_state = optimizer.state_dict()
    names = _optimizer_param_names(model, optimizer)
    moments = {
        f"state.{names[i]}.{key}": value
        for i, slots in optim_state["state"].items()
        for key, value in slots.items()
        if isinstance(value, torch.Tensor)
    }
    # An optimizer that holds the weights at a higher precision than the model (MasterAdamW's
    # fp32 masters under bf16 copies) gives them as the model's state.
    full_precision = getattr(optimizer, "full_precision_state", None)
    weights = full_precision(model) if full_precision else model.state_dict()
    groups = [
        {k: _json_value(v) for k, v in g.items() if k != "params"}
        for g in optim_state["param_groups"]
    ]
    return weights, moments, groups


def _json_value(value: Any) -> Any:
    """A hyper-parameter as JSON holds it. One held in a device tensor (the captured step's
    learning rate, rewritten every step) is left out rather than read with a host wait."""
    if isinstance(value, torch.Tensor):
        return None
    return list(value) if isinstance(value, tuple) else value


def _optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's own order (the indices of its state_dict)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def write_safetensors(path: Path, slots: tuple[Slot, ...], data: memoryview) -> dict[str, Any]:
    """Write a safetensors file whose tensors are ``slots`` over ``data`` (their bytes end to
    end, as a ``StateSnapshot`` lays them out), straight from that buffer; fsynced. Returns
    what state.json records of it: its size and the SHA-256 of its bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for slot in slots:
        header[slot.name] = {
            "dtype": _SAFETENSORS_DTYPES[slot.dtype],
            "shape": list(slot.shape),
            "data_offsets": [slot.start, slot.start + slot.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the tensor data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(text)), text, data):
            f.write(part)
            digest.update(part)  # (hashlib lets go of the interpreter lock for large parts)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": 8 + len(text) + len(data), "sha256": digest.hexdigest()}


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


class Checkpointer:
    """Saves a run's checkpoints: the state snapshotted between two steps, the files written
    by a thread while training goes on (``background=False``: before ``save`` returns).

    One write is in flight at a time; ``save`` first waits for the previous one. ``wait``
    returns when everything asked for is on disk and raises a write's error (a full disk,
    say) as a ``GpuflowError``; call it before the process ends.
    """

    def __init__(self, run_dir: Path, device: Device, keep: int, background: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.background = background
        self._snapshots = StateSnapshot(device)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: list[Path] = []  # every checkpoint folder written, in order
        self.write_seconds: list[float] = []  # each write, snapshot copy to rename

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        names: tuple[str, ...] | None = None,
    ) -> None:
        """Checkpoint the state after step ``step`` as ``names`` (default ``step_<step>``;
        add ``best`` for the best validation loss so far)."""
        self.wait()
        names = names or (step_name(step),)
        weights, moments, groups = checkpoint_state(model, optimizer)
        snapshot = self._snapshots.capture({"model": weights, "optimizer": moments})
        record = {"step": step, "param_groups": groups, **state}
        job = lambda: self._write(snapshot, record, names)  # noqa: E731
        if not self.background:
            job()
            return
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self._thread.name = "gpuflow-checkpoint"
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error, if it had one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, GpuflowError):
                raise error
            cause = describe_os_error(error) if isinstance(error, OSError) else str(error)
            # (what the run folder's roll-back keeps: a run with any checkpoint)
            kept = (
                "the earlier checkpoints are intact: once that is fixed, run it again with --resume"
                if list_checkpoints(self.run_dir) or best_checkpoint(self.run_dir)
                else "no checkpoint of this run was saved yet: run the same command again "
                "once that is fixed"
            )
            raise GpuflowError(
                f"could not write a checkpoint into {checkpoint_dir(self.run_dir)}: {cause}; {kept}"
            ) from error

    def check(self) -> None:
        """Raise a finished write's error now (no wait for a write still running): a step can
        call this, so a failed write is reported at once, not at the next checkpoint."""
        if self._thread is not None and not self._thread.is_alive() and self._error is not None:
            self.wait()

    def close(self) -> None:
        """Finish the write in flight and let the snapshot's buffers go."""
        try:
            self.wait()
        finally:
            self._snapshots.close()

    def _write(self, snapshot: Snapshot, record: dict[str, Any], names: tuple[str, ...]) -> None:
        started = time.perf_counter()
        folder = checkpoint_dir(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{names[0]}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        linked: list[Path] = []  # the other names' temporaries, until installed
        try:
            try:
                snapshot.wait()
                files = {
                    filename: write_safetensors(
                        tmp / filename, snapshot.layout.groups[group], snapshot.group_bytes(group)
                    )
                    for group, filename in (("model", MODEL_FILE), ("optimizer", OPTIMIZER_FILE))
                }
            finally:
                snapshot.release()
            full = {**record, "files": files}
            full[RECORD_DIGEST] = record_digest(full)
            with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:
                f.write(json.dumps(full, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            # The step checkpoint goes in last: it is what a resume starts from, so a crash
            # before it repeats the steps since the previous one, and writes ``best`` again.
            for name in names[1:]:
                linked.append(_linked_copy(tmp, folder / f".{name}.tmp-{os.getpid()}"))
                _install(linked[-1], folder / name)
            _install(tmp, folder / names[0])
        finally:  # nothing of a failed write stays behind (installed ones are gone from here)
            for path in (tmp, *linked):
                shutil.rmtree(path, ignore_errors=True)
        self._prune()
        self.written.append(folder / names[0])
        self.write_seconds.append(time.perf_counter() - started)

    def _prune(self) -> None:
        """Delete all but the newest ``keep`` step checkpoints: each is renamed out of sight
        first, so a crash mid-delete leaves a temporary, never half a checkpoint."""
        for old in list_checkpoints(self.run_dir)[: -self.keep]:
            doomed = old.with_name(f".{old.name}.pruned-{os.getpid()}")
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def _install(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``; an existing ``final`` (a step saved
    again after a resume, the previous best) is moved aside first and removed after, so a
    crash in between leaves it recoverable (``remove_stale_temporaries``)."""
    retired = final.with_name(f".{final.name}.old-{os.getpid()}")
    if os.path.lexists(final) and not _written_here(final):  # refused at the start; put since
        raise GpuflowError(
            f"{final} appeared during the run and is not a checkpoint gpuflow wrote; it "
            f"was left as it is: move it out of {final.parent} and resume"
        )
    replace_folder(tmp, final, retired)
    shutil.rmtree(retired, ignore_errors=True)


def _linked_copy(source: Path, target: Path) -> Path:
    """``target``: a folder of hard links to ``source``'s files (their bytes are never
    rewritten in place, so sharing them is safe), or copies where links are not possible."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for path in source.iterdir():
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)
    fsync_dir(target)
    return target


# ---- reading --------------------------------------------------------------------------------


@dataclass
class CheckpointData:
    """A checkpoint read from disk and checked, not yet applied to a model."""

    path: Path
    record: dict[str, Any]
    weights: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.record["step"])


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointDamaged(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointDamaged(f"checkpoint file {path} is unreadable ({exc})") from None


def read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"checkpoint {path} has no readable {STATE_FILE} ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise CheckpointDamaged(f"checkpoint {path} has a {STATE_FILE} without its step")
    return record


def read_checkpoint(path: Path, optimizer: bool = True) -> CheckpointData:
    """Read and check the checkpoint at ``path``: ``CheckpointDamaged`` when its state.json
    was changed after it was written, names another step than its folder, or a file it
    reads is missing, shorter or longer than written, unreadable, or not the bytes written
    (their SHA-256; older checkpoints recorded sizes only)."""
    path = Path(path)
    record = read_record(path)
    if RECORD_DIGEST in record and record[RECORD_DIGEST] != record_digest(record):
        raise CheckpointDamaged(f"{path / STATE_FILE} was changed after it was written")
    if _is_step_name(path.name) and record["step"] != int(path.name.removeprefix(STEP_PREFIX)):
        raise CheckpointDamaged(
            f"{path / STATE_FILE} names step {record['step']}, not its folder's"
        )
    wanted = (MODEL_FILE, OPTIMIZER_FILE) if optimizer else (MODEL_FILE,)
    for filename, written in record.get("files", {}).items():  # absent in older checkpoints
        if filename not in wanted:
            continue
        size, digest = (written, None) if isinstance(written, int) else (
            written.get("bytes"), written.get("sha256")
        )  # fmt: skip
        file = path / filename
        found = file.stat().st_size if file.is_file() and not file.is_symlink() else None
        if found != size:
            state = "missing" if found is None else f"{found:,} bytes where {size:,} were written"
            raise CheckpointDamaged(f"checkpoint file {file} is {state}: it is damaged")
        if digest is not None and file_digest(file) != digest:
            raise CheckpointDamaged(
                f"checkpoint file {file} is not the bytes written (its checksum differs): it "
                "is damaged"
            )
    weights = _load_tensors(path / MODEL_FILE)
    moments = _load_tensors(path / OPTIMIZER_FILE) if optimizer else {}
    return CheckpointData(path, record, weights, moments)


def resumable_checkpoint(run_dir: Path, say: Callable[[str], None]) -> CheckpointData | None:
    """The newest checkpoint that reads whole, saying which newer ones were damaged; None
    when the run has none. Every checkpoint damaged is an error."""
    found = list_checkpoints(run_dir)
    for path in reversed(found):
        try:
            data = read_checkpoint(path)
        except CheckpointDamaged as exc:
            say(f"skipping checkpoint {path.name}: {exc}")
            continue
        if path != found[-1]:
            say(f"resuming from the intact checkpoint {path.name} instead")
        return data
    if found:
        raise GpuflowError(
            f"every checkpoint of {run_dir} is damaged (see above); start a new run with "
            "another --name"
        )
    return None


def load_weights(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load ``path``'s weights into ``model`` after checking every shape; returns its record."""
    data = read_checkpoint(path, optimizer=False)
    check_state_shapes(model.state_dict(), data.weights, f"checkpoint {path}")
    model.load_state_dict(data.weights)
    return data.record


def apply_checkpoint(
    data: CheckpointData, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Put ``data``'s weights into ``model`` and its moments into ``optimizer``."""
    path = data.path
    check_state_shapes(model.state_dict(), data.weights, f"checkpoint {path}")
    index_of = {name: i for i, name in enumerate(_optimizer_param_names(model, optimizer))}
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in data.moments.items():
        param_name, _, slot = key.removeprefix("state.").rpartition(".")
        if param_name not in index_of:
            raise GpuflowError(f"checkpoint {path} has optimizer state for unknown {param_name}")
        slots.setdefault(index_of[param_name], {})[slot] = value
    live_groups = optimizer.state_dict()["param_groups"]
    if len(live_groups) != len(data.record["param_groups"]):
        raise GpuflowError(f"checkpoint {path} was saved by a different optimizer setup")
    groups = [
        {
            **live,
            **{k: v for k, v in saved.items() if v is not None},  # None: not saved (see above)
            "betas": tuple(saved["betas"]),  # JSON made the tuple a list
            **{k: live[k] for k in _EXECUTION_FLAGS if k in live},
            "params": live["params"],
        }
        for saved, live in zip(data.record["param_groups"], live_groups, strict=True)
    ]
    model.load_state_dict(data.weights)
    optimizer.load_state_dict({"state": slots, "param_groups": groups})
