"""How a step's sequences are split: the micro-batch each forward and backward takes, and how
many micro-batches each rank sums before the update (gradient accumulation).

``train.batch_tokens`` says how many tokens one optimizer step trains over the whole job;
``train.batch_size`` says how many sequences one forward takes, or 0: the largest that fits
the device and divides the step, found once at start-up by ``device_fit``. A step's batch is
drawn whole, as one batch of micro_batch x accumulation sequences would be, and trained in
micro-batches of its consecutive rows: k micro-batches give the update of one batch k times
their size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.config import RunConfig

# The largest micro-batch an automatic choice takes, in tokens: past it, kernels are already
# large enough that a larger one only costs memory.
MAX_MICRO_TOKENS = 65536
# Off CUDA (no device memory to measure) an automatic micro-batch takes at most this many.
HOST_MICRO_TOKENS = 8192
# Device memory an automatic choice leaves free: the compiled step's own workspaces, the
# allocator's rounding and fragmentation.
HEADROOM = 0.1

# (sequences) -> whether a micro-batch of that many fits
Fits = Callable[[int], bool]


def validation_rows(cfg: RunConfig) -> int:
    """Windows in one validation batch (``train.eval_batches`` of them are evaluated), set by
    the recipe and never by the micro-batch, so that runs differing only in how a step is
    split (or in the device its micro-batch was found on) validate on the same windows: a
    step's sequences, up to ``MAX_MICRO_TOKENS`` of them; ``batch_size`` where a step is one
    micro-batch (no ``batch_tokens``)."""
    tc, seq_len = cfg.train, cfg.model.max_len
    if tc.batch_tokens:
        return max(1, min(tc.batch_tokens, MAX_MICRO_TOKENS) // seq_len)
    return tc.batch_size


@dataclass(frozen=True)
class Batching:
    """A run's step, split: every rank trains ``accumulation`` micro-batches of
    ``micro_batch`` sequences of ``seq_len`` tokens before each update."""

    micro_batch: int
    accumulation: int
    seq_len: int
    world_size: int = 1
    found: str | None = None  # how an automatic micro-batch was chosen

    @property
    def rows(self) -> int:
        """Sequences each rank trains per step."""
        return self.micro_batch * self.accumulation

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step trains over the whole job."""
        return self.rows * self.seq_len * self.world_size

    def describe(self) -> str:
        ranks = f" on each of {self.world_size} ranks" if self.world_size > 1 else ""
        split = (
            f"{self.accumulation} micro-batches of {self.micro_batch} x {self.seq_len}"
            if self.accumulation > 1
            else f"{self.micro_batch} x {self.seq_len}"
        )
        how = f" ({self.found})" if self.found else ""
        return f"batch: {self.tokens_per_step:,} tokens a step, {split}{ranks}{how}"


def step_rows(config: RunConfig, world_size: int) -> int:
    """Sequences each rank trains per step: ``batch_size``, or ``batch_tokens`` shared out."""
    tc, seq_len = config.train, config.model.max_len
    if not tc.batch_tokens:
        return tc.batch_size
    rows, rest = divmod(tc.batch_tokens, seq_len * world_size)
    if rest or not rows:
        per_rank = seq_len * world_size
        # The example is whole micro-batches on each rank too, which ``plan_batching`` needs.
        unit = per_rank * (tc.batch_size or 1)
        near = max(1, round(tc.batch_tokens / unit)) * unit
        raise GpuflowError(
            f"train.batch_tokens ({tc.batch_tokens:,}) does not share out into whole sequences "
            f"of {seq_len} over {world_size} rank(s); use a multiple of {per_rank:,}, such as "
            f"{near}"
        )
    return rows


def plan_batching(config: RunConfig, world_size: int = 1, fits: Fits | None = None) -> Batching:
    """The run's batching; an automatic micro-batch (``batch_size`` 0) is the largest divisor
    of the step's sequences that ``fits`` (None: off CUDA, at most ``HOST_MICRO_TOKENS``)."""
    rows, seq_len = step_rows(config, world_size), config.model.max_len
    micro, found = config.train.batch_size, None
    if micro == 0:
        micro, found = _largest_fitting(rows, seq_len, fits)
    if rows % micro:
        raise GpuflowError(
            f"train.batch_tokens ({config.train.batch_tokens:,}) gives each rank {rows} "
            f"sequences a step, which train.batch_size ({micro}) does not divide; pick a "
            f"batch_size among {', '.join(map(str, _divisors(rows)[-6:]))}, or 0 to let "
            "gpuflow find the largest that fits"
        )
    return Batching(micro, rows // micro, seq_len, world_size, found)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_fitting(rows: int, seq_len: int, fits: Fits | None) -> tuple[int, str]:
    cap = MAX_MICRO_TOKENS if fits is not None else HOST_MICRO_TOKENS
    candidates = [d for d in _divisors(rows) if d * seq_len <= cap] or [1]
    if fits is None:
        return candidates[-1], "the largest of at most 8,192 tokens, off a GPU"
    for micro in reversed(candidates):
        if fits(micro):
            return micro, "the largest that fits the device; set train.batch_size to choose"
    raise GpuflowError(
        "not even one sequence of the model fits the device's free memory beside its weights "
        "and optimizer state; lower model.max_len or the model's size"
    )


@dataclass(frozen=True)
class MemoryFit:
    """Whether a micro-batch fits: ``fixed`` + b x ``per_sequence`` bytes against ``room``."""

    fixed: int  # the gradients, the kernels' workspaces
    per_sequence: int  # activations kept for the backward, per sequence
    room: int  # free device memory, less what else the run will hold and HEADROOM

    def __call__(self, batch: int) -> bool:
        return self.fixed + batch * self.per_sequence <= self.room


def device_fit(
    model: torch.nn.Module, device: Device, seq_len: int, vocab_size: int, reserved: int
) -> MemoryFit | None:
    """How many sequences fit the device beside ``model``, its optimizer state (already made)
    and ``reserved`` more bytes (the resident corpus, an fp32 gradient sum): the peaks of an
    eager forward and backward at 1 and 2 sequences, extended in a line, against the device's
    free memory less ``HEADROOM``. None off CUDA. Eager keeps at least the activations the
    compiled step keeps, so the estimate errs towards fitting less."""
    if device.type != "cuda":
        return None
    peaks = [peak_step_bytes(model, device, seq_len, vocab_size, b) for b in (1, 2)]
    per_sequence = max(1, peaks[1] - peaks[0])
    free, total = torch.cuda.mem_get_info(device.torch)
    cached = torch.cuda.memory_reserved(device.torch) - torch.cuda.memory_allocated(device.torch)
    room = free + cached - reserved - int(HEADROOM * total)
    return MemoryFit(peaks[0] - per_sequence, per_sequence, room)


def peak_step_bytes(
    model: torch.nn.Module, device: Device, seq_len: int, vocab_size: int, batch: int
) -> int:
    """Device memory a forward and backward of ``batch`` sequences takes beyond what was
    allocated before it (the gradients included); the gradients are dropped after."""
    torch.cuda.synchronize(device.torch)
    before = torch.cuda.memory_allocated(device.torch)
    torch.cuda.reset_peak_memory_stats(device.torch)
    ids = torch.randint(vocab_size, (batch, seq_len + 1), device=device.torch)  # (b, T+1)
    with device.autocast():
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    del loss, ids
    peak = torch.cuda.max_memory_allocated(device.torch) - before
    model.zero_grad(set_to_none=True)
    return peak
