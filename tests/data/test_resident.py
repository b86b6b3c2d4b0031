"""ResidentTokens on the cpu: valid shifted pairs, determinism, ranks, resume, chunking; the
host sampler's ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.batches import WindowSampler
from gpuflow.data.resident import ResidentTokens, window_starts
from gpuflow.data.shards import Shard, write_shard

B, T = 4, 16


def _shards(tmp_path, sizes=(1000, 700, 1300), dtype=np.uint16, high=60000, seed=0):
    rng = np.random.default_rng(seed)
    shards = []
    for i, n in enumerate(sizes):
        path = tmp_path / f"train_{i:06d}.bin"
        write_shard(path, rng.integers(0, high, size=n).astype(dtype))
        shards.append(Shard.open(path))
    corpus = np.concatenate([np.asarray(s.tokens) for s in shards]).astype(np.int64)
    return shards, corpus


def _expected_starts(tokens: ResidentTokens, step: int) -> np.ndarray:
    """Where the windows of ``step`` begin in the whole corpus, computed independently."""
    chunk = tokens.chunk_of(step)
    length = min(tokens.chunk_tokens, tokens._last - tokens._first - chunk * tokens.chunk_tokens)
    local = window_starts(
        tokens._draw_seed, torch.tensor(step), torch.arange(B), torch.tensor(length - T)
    ).numpy()
    return tokens._first + chunk * tokens.chunk_tokens + local


def test_pairs_are_shifted_windows_of_the_corpus(tmp_path):
    shards, corpus = _shards(tmp_path)
    tokens = ResidentTokens(shards, "cpu", B, T, seed=7)
    for step in range(20):
        x, y = tokens.sample()
        assert x.shape == y.shape == (B, T) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, start in enumerate(_expected_starts(tokens, step)):
            window = corpus[start : start + T + 1]
            assert np.array_equal(x[row].numpy(), window[:-1])
            assert np.array_equal(y[row].numpy(), window[1:])
    assert int(tokens.step) == 20


def test_starts_cover_the_corpus_and_depend_on_the_seed(tmp_path):
    _, corpus = _shards(tmp_path)
    n = len(corpus) - T
    steps = torch.arange(500)[:, None]
    starts = window_starts(3, steps, torch.arange(B), torch.tensor(n))  # (500, B)
    assert starts.min() >= 0 and starts.max() < n
    # Close to uniform: every tenth of the range gets its share (2000 draws, 200 expected).
    counts = np.bincount((starts.flatten().numpy() * 10) // n, minlength=10)
    assert counts.min() > 140 and counts.max() < 260
    other = window_starts(4, steps, torch.arange(B), torch.tensor(n))
    assert (other != starts).float().mean() > 0.99


def test_ranks_draw_disjoint_windows(tmp_path):
    shards, corpus = _shards(tmp_path)
    spans = {}
    for rank in range(3):
        tokens = ResidentTokens(shards, "cpu", B, T, seed=1, rank=rank, world_size=3)
        starts = np.concatenate([_expected_starts(tokens, s) for s in range(200)])
        for _ in range(200):
            tokens.sample()
        spans[rank] = (starts.min(), starts.max() + T + 1)
    ordered = [spans[r] for r in range(3)]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    assert ordered[0][0] >= 0 and ordered[-1][1] <= len(corpus)


def test_host_sampled_ranks_draw_from_disjoint_shares_of_the_starts(tmp_path):
    shards, _ = _shards(tmp_path)
    whole = WindowSampler(tuple(shards), B, T, seed=1)
    windows = {}
    for rank in range(3):
        sampler = WindowSampler(tuple(shards), B, T, seed=1, rank=rank, world_size=3)
        windows[rank] = {tuple(w) for s in range(100) for w in sampler.batch(s)}
        assert all(len(w) == T + 1 for w in windows[rank])
    assert not windows[0] & windows[1] and not windows[1] & windows[2]
    assert not windows[0] & windows[2]
    # A single process draws as it always did: its own stream over every start.
    again = WindowSampler(tuple(shards), B, T, seed=1, rank=0, world_size=1)
    np.testing.assert_array_equal(whole.batch(7), again.batch(7))
    with pytest.raises(GpuflowError, match="too few for"):
        WindowSampler(tuple(shards), B, T, seed=1, rank=0, world_size=10**6)


def test_resume_continues_the_same_sequence(tmp_path):
    shards, _ = _shards(tmp_path)
    straight = ResidentTokens(shards, "cpu", B, T, seed=5)
    seen = [straight.sample()[0] for _ in range(8)]
    resumed = ResidentTokens(shards, "cpu", B, T, seed=5)
    resumed.set_step(5)
    for step in range(5, 8):
        assert torch.equal(resumed.sample()[0], seen[step])


def test_a_small_budget_streams_the_corpus_in_chunks(tmp_path):
    shards, corpus = _shards(tmp_path)
    # 3000 tokens of 2 bytes; a 2000-byte budget holds two chunks of 500 tokens.
    tokens = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    assert (tokens.chunk_tokens, tokens.n_chunks) == (500, 6)
    assert tokens.steps_per_chunk == 500 // (B * T)
    chunks_seen = set()
    for step in range(tokens.steps_per_chunk * 7):  # every chunk, then back to the first
        tokens.advance(step)
        chunks_seen.add(tokens.chunk)
        x, _ = tokens.sample()
        for row, start in enumerate(_expected_starts(tokens, step)):
            assert np.array_equal(x[row].numpy(), corpus[start : start + T])
    assert chunks_seen == set(range(6)) and tokens.chunk == 0


@pytest.mark.parametrize("mid_round", [False, True])
def test_a_run_resumed_on_other_ranks_reads_each_chunk_once_per_epoch(tmp_path, mid_round):
    shards, corpus = _shards(tmp_path)
    # 3000 tokens; a 2000-byte budget streams them as 6 chunks of 500, on 1 rank or on 2.
    two = [
        ResidentTokens(shards, "cpu", B, T, seed=2, rank=r, world_size=2, budget_bytes=2000)
        for r in range(2)
    ]
    spc = two[0].steps_per_chunk
    stop = 2 * spc - (spc // 2 if mid_round else 0)  # two rounds, the second cut short or not
    begun: list[int] = []
    for step in range(stop):
        for tokens in two:
            tokens.advance(step)
            if not begun or tokens.chunk not in begun[-2:]:
                begun.append(tokens.chunk)
            x, _ = tokens.sample()
            for row, start in enumerate(_expected_starts(tokens, step)):
                assert np.array_equal(x[row].numpy(), corpus[start : start + T])
    assert begun == [0, 1, 2, 3]  # rounds of two chunks, one per rank
    position = two[0].position(stop)
    assert two[1].position(stop) == position
    # The same ranks resume exactly where they were.
    again = ResidentTokens(shards, "cpu", B, T, seed=2, rank=1, world_size=2, budget_bytes=2000)
    again.set_step(stop, position)
    two[1].advance(stop)
    assert torch.equal(again.sample()[0], two[1].sample()[0])
    # One rank carries on from the first chunk not begun, and the epoch reads each once.
    one = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    one.set_step(stop, position)
    for step in range(stop, stop + spc * (6 - len(begun))):
        one.advance(step)
        if one.chunk != begun[-1]:
            begun.append(one.chunk)
    assert sorted(begun) == list(range(6))


def test_uint32_ids_survive_the_signed_gather(tmp_path):
    shards, corpus = _shards(tmp_path, sizes=(900,), dtype=np.uint32, high=100_000)
    assert corpus.max() > 65535
    tokens = ResidentTokens(shards, "cpu", B, T, seed=9)
    x, _ = tokens.sample()
    start = _expected_starts(tokens, 0)[0]
    assert np.array_equal(x[0].numpy(), corpus[start : start + T])


def test_a_corpus_shorter_than_a_window_is_refused(tmp_path):
    shards, _ = _shards(tmp_path, sizes=(10,))
    with pytest.raises(GpuflowError, match="fewer than one window"):
        ResidentTokens(shards, "cpu", B, T)
    with pytest.raises(GpuflowError, match="rank must be"):
        ResidentTokens(shards, "cpu", B, 4, rank=2, world_size=2)
