"""Checkpoints: safetensors weights and optimizer moments, JSON trainer state.

    runs/<name>/checkpoints/step_000300/
        model.safetensors       fp32 weights (the tied output head is the token table)
        optimizer.safetensors   AdamW moments and step counts, keyed state.<param>.<name>
        state.json              step, optimizer hyper-parameters, ``RunState`` (random
                                states, data position...), its format, each file's size
                                and SHA-256, and its own SHA-256 (written last)
    runs/<name>/checkpoints/best/   the same, at the step with the lowest validation loss

``Checkpointer.save`` writes while training goes on; ``resumable_checkpoint`` reads the newest
intact one; what a record holds and how it is verified: ``checkpoint_record``. How saving
overlaps training, and what a killed writer leaves: docs/architecture/training.md
(Checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpuflow.common.atomic import fsync_dir, open_new, replace_folder
from gpuflow.common.errors import GpuflowError
from gpuflow.common.oserrors import describe_os_error
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import check_state_shapes
from gpuflow.train.checkpoint_folder import (
    BEST,
    STEP_PREFIX,
    best_checkpoint,
    check_checkpoint_folder,
    checkpoint_dir,
    foreign_entries,
    is_step_name,
    latest_checkpoint,
    latest_step,
    list_checkpoints,
    real_dir,
    remove_stale_temporaries,
    step_name,
    written_here,
)
from gpuflow.train.checkpoint_record import (
    FORMAT,
    FORMAT_KEY,
    MODEL_FILE,
    MODEL_KEY,
    OPTIMIZER_FILE,
    RECORD_DIGEST,
    STATE_FILE,
    CheckpointDamaged,
    check_model_record,
    file_digest,
    read_record,
    record_digest,
    verify_files,
)
from gpuflow.train.run_state import RunState, best_val_loss, decode_byte_tensor, encode_tensor
from gpuflow.transfer.snapshot import Slot, Snapshot, StateSnapshot

# The checkpoint API in one place: this module's own names and those of the folder and the
# record that its callers read here.
__all__ = [
    "BEST", "FORMAT", "FORMAT_KEY", "MODEL_FILE", "MODEL_KEY", "OPTIMIZER_FILE", "RECORD_DIGEST",
    "STATE_FILE", "STEP_PREFIX", "CheckpointDamaged", "CheckpointData", "Checkpointer", "RunState",
    "apply_checkpoint", "best_checkpoint", "best_val_loss", "check_checkpoint_folder",
    "check_model_record", "checkpoint_dir", "checkpoint_state", "decode_byte_tensor",
    "encode_tensor", "file_digest", "latest_checkpoint", "latest_step", "list_checkpoints",
    "load_weights", "read_checkpoint", "read_record", "record_digest", "remove_stale_temporaries",
    "resumable_checkpoint", "step_name", "write_safetensors", "written_here",
]  # fmt: skip

# Optimizer flags that describe the machine, not the run: the live optimizer's win on load.
_EXECUTION_FLAGS = ("fused", "foreach", "capturable", "differentiable")
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


# ---- writing --------------------------------------------------------------------------------


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


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _check_moments(
    path: Path, slots: dict[int, dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
    names: list[str],
) -> None:  # fmt: skip
    """Refuse, in one line, moments that do not fit their parameters: a record that verifies
    may still come from a writer that was not gpuflow's, and torch would fail mid-step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in slots.items():
        where = f"checkpoint {path}: the optimizer state of {names[index]}"
        missing = [name for name in ("step", *_MOMENTS) if name not in state]
        if missing:
            raise GpuflowError(f"{where} has no {', '.join(missing)}; the checkpoint is damaged")
        for name in _MOMENTS:
            if state[name].shape != params[index].shape:
                raise GpuflowError(
                    f"{where}: {name} is {tuple(state[name].shape)}, not the parameter's "
                    f"{tuple(params[index].shape)}; the checkpoint is damaged"
                )
        if state["step"].numel() != 1:
            raise GpuflowError(f"{where}: its step is not one number; the checkpoint is damaged")


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
    with open(open_new(path), "wb") as f:  # created new: never through a planted link
        for part in (struct.pack("<Q", len(text)), text, data):
            f.write(part)
            digest.update(part)  # (hashlib lets go of the interpreter lock for large parts)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": 8 + len(text) + len(data), "sha256": digest.hexdigest()}


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

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """``close``: the last checkpoint is on disk before the run reports. After an error,
        quietly, so that the first error is the one reported; after a second Ctrl-C, not at
        all (the write in flight is cleared at the next start)."""
        if exc_type is None:
            self.close()
        elif not issubclass(exc_type, KeyboardInterrupt):
            with suppress(Exception):
                self.close()

    def _write(self, snapshot: Snapshot, record: dict[str, Any], names: tuple[str, ...]) -> None:
        started = time.perf_counter()
        folder = checkpoint_dir(self.run_dir)
        if not self.run_dir.is_dir():  # not made again: a folder of checkpoints alone is no run
            raise GpuflowError(
                f"the run folder {self.run_dir} was removed or moved during the run (its "
                "config, metrics and tokenizer with it); the run stops, nothing more written"
            )
        folder.mkdir(exist_ok=True)
        if not real_dir(folder):  # refused at the start (check_checkpoint_folder); put since
            raise GpuflowError(
                f"{folder} became a link or a file during the run; gpuflow writes its "
                "checkpoints only into a folder of the run: move it out of the run and resume"
            )
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
            full = {**record, FORMAT_KEY: FORMAT, "files": files}
            full[RECORD_DIGEST] = record_digest(full)
            with open(open_new(tmp / STATE_FILE), "w", encoding="utf-8") as f:
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
        first, so a crash mid-delete leaves a temporary, never half a checkpoint. One that
        holds files gpuflow did not write is kept whole, theirs with it."""
        for old in list_checkpoints(self.run_dir)[: -self.keep]:
            if foreign_entries(old):
                continue
            doomed = old.with_name(f".{old.name}.pruned-{os.getpid()}")
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _install(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``; an existing ``final`` (a step saved
    again after a resume, the previous best) is moved aside first and removed after, so a
    crash in between leaves it recoverable (``remove_stale_temporaries``)."""
    retired = final.with_name(f".{final.name}.old-{os.getpid()}")
    if os.path.lexists(final) and not written_here(final):  # refused at the start; put since
        raise GpuflowError(
            f"{final} appeared during the run and is not a checkpoint gpuflow wrote; it "
            f"was left as it is: move it out of {final.parent} and resume"
        )
    # What the user put in the one replaced moves to its successor (and back if it fails).
    theirs = foreign_entries(final) if os.path.lexists(final) else []
    for name in theirs:
        os.replace(final / name, tmp / name)
    try:
        replace_folder(tmp, final, retired)
    except OSError:
        for name in theirs:
            os.replace(tmp / name, final / name)
        raise
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


def read_checkpoint(path: Path, optimizer: bool = True) -> CheckpointData:
    """Read and check the checkpoint at ``path``: ``CheckpointDamaged`` when its state.json
    lacks the checksums its format carries, was changed after it was written, has a field of
    the wrong kind or names another step than its folder, or a file it reads is missing, a
    link, shorter or longer than written, unreadable, or not the bytes written
    (``checkpoint_record``)."""
    path = Path(path)
    record = read_record(path)
    if is_step_name(path.name) and record["step"] != int(path.name.removeprefix(STEP_PREFIX)):
        raise CheckpointDamaged(
            f"{path / STATE_FILE} names step {record['step']}, not its folder's"
        )
    wanted = (MODEL_FILE, OPTIMIZER_FILE) if optimizer else (MODEL_FILE,)
    verify_files(path, record, wanted)
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
            if "rng" not in data.record:  # (other writers' records may go without)
                raise CheckpointDamaged(f"{path / STATE_FILE} has no random states to resume")
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
    _check_moments(path, slots, optimizer, list(index_of))
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
