"""ResidentTokens on the cpu: valid shifted pairs, determinism, ranks, resume, chunks of pieces
reshuffled each round; the host sampler's ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.batches import WindowSampler
from gpuflow.data.resident.sources import ResidentBatches
from gpuflow.data.resident.tokens import ResidentTokens, window_starts
from gpuflow.data.shards import Shard, write_shard
from gpuflow.device.accelerator import Device

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
    """Where the windows of ``step`` begin in the whole corpus, computed independently: the
    step's starts among the chunk's, each mapped to its piece and the offset in it."""
    chunk = tokens.chunk_of(step)
    if tokens.n_chunks == 1:
        length = tokens._last - tokens._first
        local = window_starts(
            tokens._draw_seed, torch.tensor(step), torch.arange(B), torch.tensor(length - T)
        ).numpy()
        return tokens._first + local
    pieces = tokens.chunk_pieces(chunk)
    piece = tokens.piece_tokens
    lengths = np.minimum(piece, tokens._last - pieces * piece)  # the corpus's last may be short
    n = int((lengths - T).clip(min=0).sum())
    local = window_starts(tokens._draw_seed, torch.tensor(step), torch.arange(B), torch.tensor(n))
    per_piece = piece - T  # starts in a whole piece: its length less a window, plus one
    return pieces[local.numpy() // per_piece] * piece + local.numpy() % per_piece


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


def test_seeds_that_share_their_low_half_draw_other_windows(tmp_path):
    """All 64 bits of the seed count, as they do for ResidentLoader; seeds below 2**32 draw
    the windows they always have."""
    shards, _ = _shards(tmp_path)
    steps, rows, n = torch.arange(50)[:, None], torch.arange(B), torch.tensor(2000)
    low = window_starts(1, steps, rows, n)
    assert (window_starts(1 + 2**32, steps, rows, n) != low).float().mean() > 0.99
    for seed in (1 + 2**32, 2**64 - 1, -1):
        drawn = [ResidentTokens(shards, "cpu", B, T, seed=seed, world_size=2, rank=r)
                 for r in range(2)]  # fmt: skip
        for tokens in drawn:
            for step in range(5):
                x, _ = tokens.sample()
                starts = _expected_starts(tokens, step)
                assert x[:, 0].tolist() == [int(v) for v in tokens_at(shards, starts)]
    assert torch.equal(
        ResidentTokens(shards, "cpu", B, T, seed=-1).sample()[0],
        ResidentTokens(shards, "cpu", B, T, seed=2**64 - 1).sample()[0],
    )  # as torch.manual_seed reads a negative seed


def tokens_at(shards, starts):
    corpus = np.concatenate([np.asarray(s.tokens) for s in shards])
    return corpus[starts]


@pytest.mark.parametrize(
    ("shards", "batch_size", "seq_len", "seed", "message"),
    [(None, 0, T, 0, "at least 1 and shards given, got 0, 16 and 3 shards"),
     (None, B, 0, 0, "got 4, 0 and 3 shards"), ([], B, T, 0, "got 4, 16 and 0 shards"),
     (None, B, T, 2**64, "seed must be an integer"),
     (None, B, T, 1.5, "seed must be an integer")],
)  # fmt: skip
def test_bad_arguments_are_refused_in_words(tmp_path, shards, batch_size, seq_len, seed, message):
    made, _ = _shards(tmp_path)
    with pytest.raises(GpuflowError, match=message):
        ResidentTokens(made if shards is None else shards, "cpu", batch_size, seq_len, seed=seed)


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


def test_fully_resident_draws_are_unchanged(tmp_path):
    shards, corpus = _shards(tmp_path)
    tokens = ResidentTokens(shards, "cpu", B, T, seed=7)
    # Starts drawn for steps 0 and 3 before corpora streamed in pieces (2984 starts).
    for step, starts in ((0, [1447, 1915, 2530, 2280]), (3, [2478, 1632, 984, 961])):
        tokens.set_step(step)
        x, _ = tokens.sample()
        assert np.array_equal(x.numpy(), np.stack([corpus[s : s + T] for s in starts]))
    assert tokens.n_chunks == 1 and tokens.turn_stats() is None


def test_a_small_budget_cuts_the_corpus_into_pieces_and_rounds(tmp_path):
    shards, _ = _shards(tmp_path, sizes=(4000, 3000, 5000))
    # 12,000 tokens; a 2000-byte budget: buffers of 500 tokens, pieces of 4 windows (68), 7
    # to a chunk; the 32-token tail is a short 177th piece.
    tokens = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    shape = (tokens.piece_tokens, tokens.n_pieces, tokens.pieces_per_chunk, tokens.n_chunks)
    assert shape == (68, 177, 7, 26) and tokens.chunk_tokens == 476
    assert tokens.steps_per_chunk == 476 // (B * T)
    rounds = []
    for round_ in range(3):
        chunks = [tokens.chunk_pieces(round_ * 26 + place) for place in range(26)]
        assert sorted(len(c) for c in chunks)[0] >= 6  # shares of equal size, within one
        assert np.array_equal(np.sort(np.concatenate(chunks)), np.arange(177))  # each once
        rounds.append(chunks)
        # A chunk is pieces from across the corpus, not one span of it.
        assert all((np.diff(c) > 1).any() for c in chunks)
        spread = np.mean([(c.max() - c.min()) / 177 for c in chunks])
        assert spread > 0.5
    assert not np.array_equal(rounds[0][0], rounds[1][0])
    assert not np.array_equal(rounds[1][0], rounds[2][0])
    # Every rank finds the same rounds; another seed other ones.
    other_rank = ResidentTokens(
        shards, "cpu", B, T, seed=2, rank=1, world_size=2, budget_bytes=2000
    )
    assert np.array_equal(other_rank.chunk_pieces(30), tokens.chunk_pieces(30))
    other_seed = ResidentTokens(shards, "cpu", B, T, seed=3, budget_bytes=2000)
    assert not np.array_equal(other_seed.chunk_pieces(0), tokens.chunk_pieces(0))
    # Where windows are short, the budget sets the pieces: buffers of 3000 tokens hold 63
    # pieces of 47 (3000 / 64, rounded up); the 256 pieces make 5 chunks of 51 or 52.
    larger = ResidentTokens(shards, "cpu", B, 4, seed=2, budget_bytes=12000)
    assert (larger.piece_tokens, larger.n_pieces, larger.n_chunks) == (47, 256, 5)
    assert larger.pieces_per_chunk == 52


def test_streamed_windows_lie_inside_one_piece_of_the_corpus(tmp_path):
    shards, corpus = _shards(tmp_path, sizes=(4000, 3000, 5000))
    tokens = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    piece = tokens.piece_tokens
    where: dict[tuple[int, int], list[int]] = {}  # (first two tokens) -> where they are
    for at in range(len(corpus) - 1):
        where.setdefault((corpus[at], corpus[at + 1]), []).append(at)
    offsets, first_chunk = set(), []
    for step in range(tokens.steps_per_chunk * 30):  # past the first round of 26 chunks
        tokens.advance(step)
        x, y = tokens.sample()
        windows = torch.cat([x, y[:, -1:]], dim=1).numpy()  # (B, T+1)
        for window in windows:
            found = [
                at for at in where.get((window[0], window[1]), [])
                if np.array_equal(corpus[at : at + T + 1], window)
            ]  # fmt: skip
            assert len(found) == 1
            at = found[0]
            assert at // piece == (at + T) // piece  # inside one piece
            assert at // piece in tokens.chunk_pieces(tokens.chunk)  # of the active chunk
            offsets.add(at % piece)
            if tokens.chunk == 0:
                first_chunk.append(at // piece)
    assert {0, piece - T - 1} <= offsets  # a piece's first start and its last
    assert max(offsets) == piece - T - 1
    # The first chunk's batches already come from many pieces across the corpus.
    assert len(set(first_chunk)) >= 5 and max(first_chunk) - min(first_chunk) > 177 // 2


@pytest.mark.parametrize("stop", [3 * 7 + 2, 26 * 7 - 3])  # mid-round; a round ends after
def test_a_resumed_run_draws_the_same_streamed_windows(tmp_path, stop):
    shards, _ = _shards(tmp_path, sizes=(4000, 3000, 5000))
    straight = ResidentTokens(shards, "cpu", B, T, seed=4, budget_bytes=2000)
    assert straight.steps_per_chunk == 7 and straight.n_chunks == 26
    seen = []
    for step in range(stop + 10):
        straight.advance(step)
        seen.append(straight.sample()[0])
    resumed = ResidentTokens(shards, "cpu", B, T, seed=4, budget_bytes=2000)
    resumed.set_step(stop, straight.position(stop))
    for step in range(stop, stop + 10):
        resumed.advance(step)
        assert torch.equal(resumed.sample()[0], seen[step])
    assert resumed.chunk == (stop + 9) // 7  # the counter runs on into the next round


def test_turn_stats_count_the_turns_and_their_bytes(tmp_path):
    shards, _ = _shards(tmp_path)
    tokens = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    assert tokens.turn_stats()["turns"] == 0  # the first upload is no turn
    spc = tokens.steps_per_chunk
    for step in range(spc * 3 + 1):  # three turns: into chunks 1, 2 and 3
        tokens.advance(step)
        tokens.sample()
    stats = tokens.turn_stats()
    # Each turn starts the upload of the chunk after it (chunks 2, 3 and 4).
    uploaded = sum(n for chunk in (2, 3, 4) for _, n in tokens._spans(chunk))
    assert (stats["turns"], stats["bytes"]) == (3, 2 * uploaded) and stats["seconds"] > 0
    assert stats["n_chunks"] == tokens.n_chunks == 7
    # The trainer's source passes them on; a resident corpus has none.
    cpu = Device.resolve("cpu")
    batches = ResidentBatches(tuple(shards), cpu, B, T, seed=2, start=0, budget_bytes=2000)
    batches.prepare(spc)
    assert batches.turn_stats()["turns"] == 1
    assert ResidentBatches(tuple(shards), cpu, B, T, seed=2, start=0).turn_stats() is None


@pytest.mark.parametrize("mid_round", [False, True])
def test_a_run_resumed_on_other_ranks_reads_each_chunk_once_per_round(tmp_path, mid_round):
    shards, corpus = _shards(tmp_path)
    # 3000 tokens; a 2000-byte budget streams them as 7 chunks of 6-7 pieces, on 1 rank or 2.
    two = [
        ResidentTokens(shards, "cpu", B, T, seed=2, rank=r, world_size=2, budget_bytes=2000)
        for r in range(2)
    ]
    spc, n_chunks = two[0].steps_per_chunk, two[0].n_chunks
    stop = 2 * spc - (spc // 2 if mid_round else 0)  # two turns, the second cut short or not
    begun: list[int] = []
    for step in range(stop):
        for tokens in two:
            tokens.advance(step)
            if not begun or tokens.chunk not in begun[-2:]:
                begun.append(tokens.chunk)
            x, _ = tokens.sample()
            for row, start in enumerate(_expected_starts(tokens, step)):
                assert np.array_equal(x[row].numpy(), corpus[start : start + T])
    assert begun == [0, 1, 2, 3]  # turns of two chunks, one per rank
    position = two[0].position(stop)
    assert two[1].position(stop) == position and position["next_chunk"] == 4
    # The same ranks resume exactly where they were.
    again = ResidentTokens(shards, "cpu", B, T, seed=2, rank=1, world_size=2, budget_bytes=2000)
    again.set_step(stop, position)
    two[1].advance(stop)
    assert torch.equal(again.sample()[0], two[1].sample()[0])
    # One rank carries on from the first chunk not begun: the round reads each piece once.
    one = ResidentTokens(shards, "cpu", B, T, seed=2, budget_bytes=2000)
    one.set_step(stop, position)
    for step in range(stop, stop + spc * (n_chunks - len(begun))):
        one.advance(step)
        if one.chunk != begun[-1]:
            begun.append(one.chunk)
    assert sorted(begun) == list(range(n_chunks))
    pieces = np.concatenate([one.chunk_pieces(chunk) for chunk in begun])
    assert np.array_equal(np.sort(pieces), np.arange(one.n_pieces))


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
