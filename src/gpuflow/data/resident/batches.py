"""Host-side batch sampling from token shards: windows of ``seq_len + 1`` tokens.

The draw for step ``s`` depends only on ``(seed, s)``, so the data position a checkpoint
must record is the step itself, and a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import numpy as np

from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import Shard


class WindowSampler:
    """Uniform random windows over every shard, never crossing a shard boundary. Rank
    ``rank`` of ``world_size`` draws from its own contiguous share of the window starts, so
    the ranks of a data-parallel job never draw the same window."""

    def __init__(
        self, shards: tuple[Shard, ...], batch_size: int, seq_len: int, seed: int,
        rank: int = 0, world_size: int = 1,
    ) -> None:  # fmt: skip
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
        total = int(self._cumulative[-1])
        self._first, self._last = total * rank // world_size, total * (rank + 1) // world_size
        if self._last <= self._first:
            raise GpuflowError(
                f"the train split has {total} window starts, too few for {world_size} ranks: "
                "prepare more text or train on fewer GPUs"
            )
        # Each rank its own stream: equal shares must not be read at the same offsets.
        self._key = (seed,) if world_size == 1 else (seed, rank)

    def batch(self, step: int) -> np.ndarray:
        """Tokens for ``step``, shape (batch_size, seq_len + 1), in the shards' dtype."""
        rng = np.random.default_rng((*self._key, step))
        flat = rng.integers(self._first, self._last, size=self.batch_size)  # (B,)
        shard_ids = np.searchsorted(self._cumulative, flat, side="right")  # (B,)
        offsets = flat - np.concatenate(([0], self._cumulative[:-1]))[shard_ids]  # (B,)
        return np.stack(
            [self._maps[i][o : o + self.window] for i, o in zip(shard_ids, offsets, strict=True)]
        )


def window_starts(shards: tuple[Shard, ...], seq_len: int) -> int:
    """How many distinct windows of ``seq_len + 1`` tokens ``shards`` hold (none crosses
    from one shard into the next)."""
    return sum(max(0, s.n_tokens - seq_len) for s in shards)


def check_validation_batch(shards: tuple[Shard, ...], batch_size: int, seq_len: int) -> None:
    """Refuse, before any window is built, a val split with no window of ``seq_len + 1``
    tokens, or fewer distinct windows than one batch of ``batch_size`` takes."""
    window, starts = seq_len + 1, window_starts(shards, seq_len)
    if starts == 0:
        raise GpuflowError(
            f"the val split has no run of {window} tokens (model.max_len + 1); prepare with a "
            "larger --val-fraction or more text, or lower model.max_len"
        )
    if batch_size > starts:
        raise GpuflowError(
            f"train.batch_size ({batch_size:,} sequences, the micro-batch that validation also "
            f"takes) is more than the val split's {starts:,} distinct windows of {window} "
            "tokens; lower train.batch_size, or prepare with a larger --val-fraction or more text"
        )


def validation_windows(
    shards: tuple[Shard, ...], batch_size: int, seq_len: int, max_batches: int
) -> list[np.ndarray]:
    """A fixed validation set: windows spread evenly over the whole val split.

    Returns up to ``max_batches`` arrays of shape (batch_size, seq_len + 1); every run of the
    same data and shape evaluates on the same tokens. Windows are disjoint while the split
    has room for them; a split too short for one full batch of disjoint windows still gives
    one batch, of overlapping windows.
    """
    window = seq_len + 1
    starts_per_shard = np.array([max(0, s.n_tokens - window + 1) for s in shards])
    check_validation_batch(shards, batch_size, seq_len)  # before anything is allocated
    disjoint = sum(max(0, (s.n_tokens - 1) // seq_len) for s in shards)
    n_windows = batch_size * min(max_batches, max(1, disjoint // batch_size))
    cumulative = np.cumsum(starts_per_shard)  # (n_shards,)
    flat = np.linspace(0, cumulative[-1] - 1, n_windows).round().astype(np.int64)  # (N,)
    shard_ids = np.searchsorted(cumulative, flat, side="right")  # (N,)
    offsets = flat - np.concatenate(([0], cumulative[:-1]))[shard_ids]  # (N,)
    maps = [s.tokens for s in shards]
    windows = np.stack(
        [maps[i][o : o + window] for i, o in zip(shard_ids, offsets, strict=True)]
    )  # (N, T+1)
    return list(windows.reshape(-1, batch_size, window))
