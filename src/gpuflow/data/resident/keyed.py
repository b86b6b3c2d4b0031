"""Random numbers that are a pure function of integer keys, drawn on the device.

    keys = sample_keys(seed, epoch, positions)      # (B,) int64 in [0, 2**32); any 64-bit seed
    shift = below(keys, stream=1, n=9)              # (B,) int64 in [0, 9)

No generator state: the same (seed, epoch, position) gives the same numbers on every run,
device and batch size, inside a CUDA graph or not, and a resumed run needs only its position.
Every function queues device work only (no host sync); ``epoch`` and ``positions`` may be
Python ints or device tensors.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
SEEDS = (-(1 << 63), 1 << 64)  # the seeds torch.manual_seed takes: [low, high)
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, no overflow.
_MIX = (0x7FEB352D, 0x2C1B3C6D)
STREAMS = (0x9E3779B1, 0x85EBCA77)  # constants that start independent hash streams
_HIGH_SEED = 0xC2B2AE3D  # starts the stream of a seed's high 32 bits


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX[0]) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX[1]) & MASK32
    return x ^ (x >> 16)


def check_seed(seed: Any) -> int:
    """``seed`` as an int, refused where ``torch.manual_seed`` would refuse it."""
    try:
        value = operator.index(seed)
    except TypeError:
        value = None
    if value is None or isinstance(seed, bool) or not SEEDS[0] <= value < SEEDS[1]:
        raise GpuflowError(
            f"seed must be an integer in [-2**63, 2**64), as torch.manual_seed takes, got {seed!r}"
        )
    return value


def _hash32_int(x: int) -> int:
    """``hash32`` of one Python int in [0, 2**32), on the host."""
    x ^= x >> 16
    x = (x * _MIX[0]) & MASK32
    x ^= x >> 15
    x = (x * _MIX[1]) & MASK32
    return x ^ (x >> 16)


def sample_keys(seed: int, epoch: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One key per sample from the run's seed (all 64 bits of it; a negative seed as its
    two's complement, as torch reads it), the epoch and each sample's place in the epoch's
    order: (B,) int64 in [0, 2**32)."""
    seed &= MASK64
    base = hash32(torch.full_like(positions, seed & MASK32) ^ STREAMS[0])
    with_epoch = hash32(base ^ (epoch & MASK32))
    keys = hash32(with_epoch ^ (positions & MASK32))
    return mix_high_seed(keys, seed)


def mix_high_seed(keys: torch.Tensor, seed: int) -> torch.Tensor:
    """``keys`` with the high half of a 64-bit ``seed`` mixed in: seeds that share their low
    half differ at every key, and seeds below 2**32 keep the keys they have always had."""
    seed &= MASK64
    if not seed >> 32:
        return keys
    return hash32(keys ^ _hash32_int((seed >> 32) ^ _HIGH_SEED))


def stream_keys(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """Keys for the ``stream``-th independent draw made from each sample's key."""
    return hash32(keys ^ ((STREAMS[1] * (stream + 1)) & MASK32))


def below(keys: torch.Tensor, stream: int, n: int | torch.Tensor) -> torch.Tensor:
    """An int64 in [0, n) per key (n at most 2**32; the bias of the modulo is below
    n / 2**32)."""
    return stream_keys(keys, stream) % n


def uniform(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """A float32 in [0, 1) per key: 24 bits, which float32 holds exactly (32 would round
    the largest draws up to 1)."""
    return (stream_keys(keys, stream) >> 8).to(torch.float32) * (1.0 / 2**24)


def order_keys(seed: int, epoch: int, n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64 sort keys whose stable argsort is the epoch's permutation of range(n):
    62 bits from two streams, so ties (broken by index) are rare."""
    index = torch.arange(n, device=device, dtype=torch.int64)  # (n,)
    key = sample_keys(seed, epoch, index)
    high = stream_keys(key, 0) >> 2  # 30 bits
    return (high << 32) | stream_keys(key, 1)
