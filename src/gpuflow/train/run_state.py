"""What a run records in a checkpoint beyond its weights and moments (``RunState``: random
states, data position, tokens seen, latest validation loss, the logging interval it came
inside, the model's shape), and the best checkpoint's validation loss."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.device.accelerator import Device
from gpuflow.train.checkpoint_folder import best_checkpoint
from gpuflow.train.checkpoint_record import MODEL_KEY, CheckpointDamaged, read_record


def encode_tensor(t: torch.Tensor) -> str:
    """Base64 of a host tensor's bytes (RNG states live on the host, even for CUDA)."""
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def decode_byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


@dataclass(frozen=True)
class RunState:
    """What a training run's checkpoint holds beyond weights and optimizer (state.json): the
    random states, the data position (every data path draws step s's batch from (seed, s),
    plus a streamed corpus's place in its chunk order), the tokens trained so far, the
    latest validation loss, and the logging interval the checkpoint came inside, if it did
    (``IntervalPart.as_record``). The record's layout lives here alone."""

    data: dict[str, Any]
    tokens_seen: int
    val_loss: float | None
    rng_torch: torch.Tensor
    rng_device: torch.Tensor | None
    interval: dict[str, Any] | None = None
    model: dict[str, int] | None = None  # the shape trained (ModelConfig's fields)

    @classmethod
    def now(
        cls, device: Device, data: dict[str, Any], tokens_seen: int, val_loss: float | None,
        interval: dict[str, Any] | None = None, model: dict[str, int] | None = None,
    ) -> RunState:  # fmt: skip
        """The run's state after its latest step, random states read now."""
        rng = torch.get_rng_state(), device.rng_state()
        return cls(data, tokens_seen, val_loss, *rng, interval, model)

    def as_record(self) -> dict[str, Any]:
        rng_device = encode_tensor(self.rng_device) if self.rng_device is not None else None
        return {
            "rng": {"torch": encode_tensor(self.rng_torch), "device": rng_device},
            "data": dict(self.data),
            "tokens_seen": self.tokens_seen,
            "val_loss": self.val_loss,
            **({"interval": self.interval} if self.interval is not None else {}),
            **({MODEL_KEY: self.model} if self.model is not None else {}),
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
            interval=record.get("interval"),
            model=record.get(MODEL_KEY),
        )

    def restore_rng(self, device: Device) -> None:
        """Put the random states back (the device's where it has one); a state torch cannot
        take (the right kind of field, the wrong bytes) is one line."""
        try:
            torch.set_rng_state(self.rng_torch)
            if self.rng_device is not None and device.rng_state() is not None:
                device.set_rng_state(self.rng_device)
        except RuntimeError as exc:
            raise CheckpointDamaged(
                f"the checkpoint's random state cannot be restored ({exc}); move that "
                "checkpoint out of the run's checkpoints/ to resume from an earlier one"
            ) from None


def best_val_loss(run_dir: Path, say: Callable[[str], None] | None = None) -> float:
    """The validation loss of the run's best checkpoint, read once its record verifies: inf
    if it has none, or a damaged one (which only loses its record: the next validation
    replaces it; ``say`` hears why)."""
    best = best_checkpoint(run_dir)
    if best is None:
        return math.inf
    try:
        value = read_record(best).get("val_loss")
    except CheckpointDamaged as exc:
        if say is not None:
            say(f"the best checkpoint is damaged ({exc}); the next validation replaces it")
        return math.inf
    return float(value) if value is not None else math.inf
