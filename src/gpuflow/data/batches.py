"""Host-side batch sampling from token shards: windows of ``seq_len + 1`` tokens.

The draw for step ``s`` depends only on ``(seed, s)``, so the data position a checkpoint
must record is the step itself, and a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import numpy as np

from gpuflow.data.shards import Shard
from gpuflow.errors import GpuflowError


class WindowSampler:
    """Uniform random windows over every shard, never crossing a shard boundary."""

    def __init__(self, shards: tuple[Shard, ...], batch_size: int, seq_len: int, seed: int) -> None:
        self.shards = shards
        self.batch_size = batch_size
        self.window = seq_len + 1
        self.seed = seed
        starts_per_shard = np.array([max(0, s.n_tokens - self.window + 1) for s in shards])
        if starts_per_shard.sum() == 0:
            raise GpuflowError(
                f"the train split has no run of {self.window} tokens (model.max_len + 1); "
                "prepare more text or lower model.max_len"
            )
        self._cumulative = np.cumsum(starts_per_shard)  # (n_shards,)
        self._maps = [s.tokens for s in shards]

    def batch(self, step: int) -> np.ndarray:
        """Tokens for ``step``, shape (batch_size, seq_len + 1), in the shards' dtype."""
        rng = np.random.default_rng((self.seed, step))
        flat = rng.integers(0, self._cumulative[-1], size=self.batch_size)  # (B,)
        shard_ids = np.searchsorted(self._cumulative, flat, side="right")  # (B,)
        offsets = flat - np.concatenate(([0], self._cumulative[:-1]))[shard_ids]  # (B,)
        return np.stack(
            [self._maps[i][o : o + self.window] for i, o in zip(shard_ids, offsets, strict=True)]
        )


def validation_windows(
    shards: tuple[Shard, ...], batch_size: int, seq_len: int, max_batches: int
) -> list[np.ndarray]:
    """A fixed validation set: back-to-back windows from the start of the val split.

    Returns up to ``max_batches`` arrays of shape (batch_size, seq_len + 1); every run of
    the same data and shape evaluates on the same tokens.
    """
    window = seq_len + 1
    windows = []
    for shard in shards:
        tokens = shard.tokens
        for start in range(0, shard.n_tokens - window + 1, seq_len):
            windows.append(tokens[start : start + window])
            if len(windows) == batch_size * max_batches:
                break
        if len(windows) == batch_size * max_batches:
            break
    n_batches = len(windows) // batch_size
    if n_batches == 0:
        raise GpuflowError(
            f"the val split has fewer than {batch_size} windows of {window} tokens; prepare "
            "with a larger --val-fraction or more text, or lower train.batch_size or model.max_len"
        )
    return [np.stack(windows[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)]
