"""Checkpoints: safetensors weights and optimizer moments, JSON trainer state.

    runs/<name>/checkpoints/step_000300/
        model.safetensors       fp32 weights (the tied output head is the token table)
        optimizer.safetensors   AdamW moments and step counts, keyed state.<param>.<name>
        state.json              step, optimizer hyper-parameters, RNG states, data position

A checkpoint is built in a hidden temporary folder, every file fsynced, then renamed into
place, so ``step_*`` folders are always complete. The newest ``keep`` are kept.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gpuflow.atomic import fsync_dir
from gpuflow.errors import GpuflowError
from gpuflow.mirror import host_snapshot, read_now
from gpuflow.model import check_state_shapes
from gpuflow.train.master_adamw import MasterAdamW

STEP_PREFIX = "step_"
# Optimizer flags that describe the machine, not the run: the live optimizer's win on load.
_EXECUTION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if p.name.startswith(STEP_PREFIX) and p.is_dir() and (p / "state.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def encode_tensor(t: torch.Tensor) -> str:
    """Base64 of a host tensor's bytes (RNG states live on the host, even for CUDA)."""
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def decode_byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write ``step_<step>`` atomically and prune to the newest ``keep``; returns its path."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{STEP_PREFIX}{step:06d}"
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        optim_state = optimizer.state_dict()
        param_names = _optimizer_param_names(model, optimizer)
        optim_tensors = {
            f"state.{param_names[i]}.{key}": value
            for i, slots in optim_state["state"].items()
            for key, value in slots.items()
            if isinstance(value, torch.Tensor)
        }
        weights = (
            optimizer.full_precision_state(model)  # the fp32 masters, not the bf16 copies
            if isinstance(optimizer, MasterAdamW)
            else model.state_dict()
        )
        save_file(host_snapshot(weights), str(tmp / "model.safetensors"))
        save_file(host_snapshot(optim_tensors), str(tmp / "optimizer.safetensors"))
        groups = [
            {k: _json_value(v) for k, v in g.items() if k != "params"}
            for g in optim_state["param_groups"]
        ]
        record = {"step": step, "param_groups": groups, **state}
        (tmp / "state.json").write_text(json.dumps(record, indent=1) + "\n")
        for path in tmp.iterdir():
            _fsync_file(path)
        fsync_dir(tmp)
        if final.exists():  # re-saving a step after a resume: the new copy wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _json_value(value: Any) -> Any:
    """A hyper-parameter as JSON holds it (a learning rate may be a device tensor)."""
    if isinstance(value, torch.Tensor):
        return read_now(value)[0]
    return list(value) if isinstance(value, tuple) else value


def _optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's own order (the indices of its state_dict)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise GpuflowError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise GpuflowError(f"checkpoint file {path} is unreadable ({exc})") from None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Load ``path/model.safetensors`` into ``model`` after checking every shape."""
    weights = _load_tensors(path / "model.safetensors")
    check_state_shapes(model.state_dict(), weights, f"checkpoint {path}")
    model.load_state_dict(weights)


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore weights and optimizer from ``path``; return the JSON trainer state."""
    try:
        record = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise GpuflowError(f"checkpoint {path} has no readable state.json ({exc})") from None
    load_weights(path, model)
    tensors = _load_tensors(path / "optimizer.safetensors")
    index_of = {name: i for i, name in enumerate(_optimizer_param_names(model, optimizer))}
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        param_name, _, slot = key.removeprefix("state.").rpartition(".")
        if param_name not in index_of:
            raise GpuflowError(f"checkpoint {path} has optimizer state for unknown {param_name}")
        slots.setdefault(index_of[param_name], {})[slot] = value
    live_groups = optimizer.state_dict()["param_groups"]
    if len(live_groups) != len(record["param_groups"]):
        raise GpuflowError(f"checkpoint {path} was saved by a different optimizer setup")
    groups = [
        {
            **saved,
            "betas": tuple(saved["betas"]),  # JSON made the tuple a list
            **{k: live[k] for k in _EXECUTION_FLAGS if k in live},
            "params": live["params"],
        }
        for saved, live in zip(record["param_groups"], live_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": slots, "param_groups": groups})
    return record
