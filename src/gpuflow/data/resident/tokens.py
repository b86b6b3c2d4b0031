"""``ResidentTokens``: the training corpus in device memory, batches drawn on the device.

    tokens = ResidentTokens(data.train, device, batch_size=32, seq_len=128, seed=1337)
    x, y = tokens.sample()        # (B, T) int64 each, on the device; no host work, no sync

The token shards cross the bus once, at start-up; after that a training step moves 0 bytes.
Sampling depends only on a step counter on the device (``set_step`` restores it); each of
``world_size`` ranks keeps its own slice of the corpus; a slice larger than ``budget_bytes``
streams through in chunks that take turns (``advance``), each chunk made of pieces from
across the whole corpus, reshuffled every round, so that every batch is drawn like one from
the whole corpus.

How the shards are read and checked, how windows are drawn, and how chunks are built and
take turns: docs/architecture/data.md (The resident corpus).
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import DownloadColumn

from gpuflow.common.console import progress_bar
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.keyed import MASK32, MASK64, STREAMS, check_seed, hash32, mix_high_seed
from gpuflow.data.shards import HEADER_BYTES, Shard
from gpuflow.data.tokens import check_ids
from gpuflow.device.accelerator import Device
from gpuflow.transfer.diskread import HostFileReader, KvikioReader
from gpuflow.transfer.pinned import PinnedPool

UPLOAD_CHUNK_BYTES = 64 << 20
KVIKIO_REQUEST_BYTES = 1 << 30  # kvikio splits a request among its threads itself
_PROGRESS_MIN_BYTES = 256 << 20  # smaller corpora upload too fast for a bar to help
# A streamed chunk holds up to this many pieces of the corpus: enough that a chunk's batches
# look like the whole corpus's, few enough that each piece is one long read
# (docs/decisions/045).
PIECES_PER_CHUNK = 64
MIN_PIECE_WINDOWS = 4  # a piece is at least this many windows long (when a chunk holds that)
# One read of one shard into a buffer: (shard, offset in the buffer, first token, end token
# in the shard)
Read = tuple[Shard, int, int, int]


def window_starts(
    seed: int, step: torch.Tensor, rows: torch.Tensor, n_starts: torch.Tensor
) -> torch.Tensor:
    """Start positions in [0, n_starts) for ``rows`` of batch ``step``: (B,) int64.

    A pure function of its inputs, so eager, captured and resumed runs draw the same windows.
    """
    key = (step * rows.numel() + rows) & MASK32  # (B,)
    base = mix_high_seed(hash32(torch.full_like(key, seed & MASK32) ^ STREAMS[0]), seed)
    high = hash32(hash32(key ^ base) ^ STREAMS[0]) >> 1  # 31 bits: keeps the sum < 2**63
    low = hash32(hash32(key ^ base) ^ STREAMS[1])
    return ((high << 32) | low) % n_starts


class ResidentTokens:
    """See the module docstring."""

    def __init__(
        self,
        shards: Sequence[Shard],
        device: Device | str,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        budget_bytes: int | None = None,
        vocab_size: int | None = None,
        show_progress: bool = True,
        managed: bool = False,
        io: str = "pinned",
    ) -> None:
        if not 0 <= rank < world_size:
            raise GpuflowError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_size < 1 or seq_len < 1 or not shards:
            raise GpuflowError(f"batch_size and seq_len must be at least 1 and shards given, "
                               f"got {batch_size}, {seq_len} and {len(shards)} shards")  # fmt: skip
        self.device = Device.resolve(device)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, check_seed(seed)
        # Each rank its own draws: equal slices must not be read at the same offsets (the rank
        # moves the seed's low half; the high half, a negative seed's two's complement's, stays)
        full = self.seed & MASK64
        self._draw_seed = (full & ~MASK32) | ((full + rank * STREAMS[1]) & MASK32)
        self.vocab_size = vocab_size  # ids at or past it are refused as they upload
        self.window = seq_len + 1
        dtypes = {s.dtype for s in shards}
        if len(dtypes) != 1:
            raise GpuflowError("the train shards mix uint16 and uint32 tokens; prepare them again")
        self.token_dtype = np.dtype(dtypes.pop())
        self._shards = list(shards)
        self.rank, self.world_size = rank, world_size
        # This rank's contiguous slice of the corpus (all shards end to end).
        total = sum(s.n_tokens for s in shards)
        first, last = total * rank // world_size, total * (rank + 1) // world_size
        if last - first < self.window:
            raise GpuflowError(
                f"the train split gives rank {rank} of {world_size} {last - first} "
                f"tokens, fewer than one window of {self.window} (model.max_len + 1)"
            )
        self.budget_bytes = (
            budget_bytes if budget_bytes is not None else default_budget(self.device)
        )
        itemsize = self.token_dtype.itemsize
        corpus_bytes = (last - first) * itemsize
        self._cut_pieces(total, max(self.window, self.budget_bytes // (2 * itemsize)))
        if corpus_bytes <= self.budget_bytes or self.n_chunks == 1:  # the slice stays resident
            self._first, self._last = first, last
            self.n_chunks, self.chunk_tokens = 1, last - first
            self.piece_tokens, self.n_pieces, self.pieces_per_chunk = last - first, 1, 1
        else:
            # The whole corpus streams through in chunks (``_cut_pieces``), which the ranks
            # take in turn: world_size consecutive chunks per turn. The order does not depend
            # on how many ranks there are, so a run resumed on another number of them carries
            # on where the last one stopped (``position``).
            self._first, self._last = 0, total
        self.steps_per_chunk = max(1, self.chunk_tokens // (batch_size * seq_len))
        # Window starts per piece; start s of a chunk lies in its piece s // this (``sample``).
        self._starts_per_piece = self.piece_tokens - self.window + 1
        # (the chunk counter this run's first turn starts at, the step it starts at)
        self.chunk_base = (0, 0)
        self._shard_starts = list(itertools.accumulate((s.n_tokens for s in shards), initial=0))
        self._orders: dict[int, np.ndarray] = {}  # round -> its order of the pieces
        # What chunk turns have cost so far (``turn_stats``).
        self._turns, self._turn_seconds, self._turn_bytes, self._uploaded = 0, 0.0, 0, 0
        self._show_progress = show_progress and corpus_bytes >= _PROGRESS_MIN_BYTES
        if io not in ("pinned", "kvikio"):
            raise GpuflowError(f"ResidentTokens reads through pinned or kvikio, got {io!r}")
        # kvikio reads into device memory itself; pinned stages through a pool of two buffers
        self._kvikio = KvikioReader(self.device) if io == "kvikio" else None
        self._host_reader = HostFileReader() if io == "pinned" else None
        self._pool = PinnedPool(self.device, max_bytes=2 * UPLOAD_CHUNK_BYTES)
        self._ids = _IdCheck(vocab_size, itemsize)
        self._copy_stream = self.device.new_stream()
        torch_device = self.device.torch
        # Signed views of the unsigned ids (gather works on them; ids are masked back).
        wire = torch.int16 if itemsize == 2 else torch.int32
        # In managed memory (``managed``): CUDA's unified memory, prefetched to the device.
        self.managed = managed
        empty = self._managed_empty if managed else self._device_empty
        self._active = empty(self.chunk_tokens, wire)
        self._staged = empty(self.chunk_tokens, wire) if self.n_chunks > 1 else None
        self._staged_chunk: int | None = None
        self._staged_ready = None
        self._id_mask = (1 << (8 * itemsize)) - 1  # unsigned ids back from signed views
        self.step = torch.zeros((), dtype=torch.int64, device=torch_device)
        self.n_starts = torch.zeros((), dtype=torch.int64, device=torch_device)
        self._rows = torch.arange(batch_size, device=torch_device)  # (B,)
        self._offsets = torch.arange(self.window, device=torch_device)  # (T+1,)
        self.chunk = -1
        try:
            self.set_step(0)  # the first upload: a shard it refuses leaves no reader behind
        except BaseException:
            self.close()
            raise

    # ---- sampling: device work only -------------------------------------------------------

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the current step, (B, T) int64 each, then the step counter
        moves on. Queues device work only: no copy, no sync (safe inside a CUDA graph)."""
        starts = window_starts(self._draw_seed, self.step, self._rows, self.n_starts)  # (B,)
        if self.n_chunks > 1:
            # A chunk's starts are numbered piece after piece. Its pieces lie end to end in
            # the buffer, each piece_tokens long (the corpus's last one may be shorter, and is
            # last in its chunk) and giving _starts_per_piece starts, so start s lies in piece
            # s // _starts_per_piece: stepping over the window - 1 tokens at the end of each
            # piece before it keeps every window inside one piece.
            starts = starts + starts // self._starts_per_piece * (self.window - 1)  # (B,)
        index = starts[:, None] + self._offsets  # (B, T+1)
        windows = self._active[index].long() & self._id_mask  # (B, T+1) int64 token ids
        self.step += 1
        return windows[:, :-1], windows[:, 1:]

    # ---- position: host work between steps ------------------------------------------------

    def chunk_of(self, step: int) -> int:
        """The chunk this rank trains on at ``step``: 0 (its slice) while that fits, else a
        counter that runs on past the rounds (round ``chunk // n_chunks``, place
        ``chunk % n_chunks`` in it): the ``rank``-th chunk of the turn ``step`` falls in."""
        if self.n_chunks == 1:
            return 0
        first, since = self.chunk_base
        turns = (step - since) // self.steps_per_chunk
        return first + turns * self.world_size + self.rank

    def chunk_pieces(self, chunk: int) -> np.ndarray:
        """The pieces chunk ``chunk`` holds, ascending: (n,) int64 indices, piece i being the
        corpus's tokens [i * piece_tokens, (i + 1) * piece_tokens). A round cuts its order of
        all the pieces into n_chunks shares of equal size (within one piece), so a chunk's
        steps cover its pieces about once whichever place it has."""
        if self.n_chunks == 1:  # the rank's slice, resident: one piece
            return np.zeros(1, dtype=np.int64)
        round_, place = divmod(chunk, self.n_chunks)
        order = self._round_order(round_)
        lo, hi = (p * self.n_pieces // self.n_chunks for p in (place, place + 1))
        # Ascending: the reads move forward through the files, and the corpus's last piece
        # (the one that may be short) comes last, as ``sample`` needs.
        return np.sort(order[lo:hi])

    def set_step(self, step: int, position: Mapping[str, Any] | None = None) -> None:
        """Continue from ``step`` (a resumed run; ``position`` is what ``position`` said at
        its checkpoint): its chunk is made active, the next one starts uploading."""
        self.chunk_base = self._base_after(step, position or {})
        self.step.fill_(step)
        self._activate(self.chunk_of(step))

    def position(self, step: int) -> dict[str, Any]:
        """Where a run stopping after ``step`` is in the chunk order, for its checkpoint."""
        if self.n_chunks == 1:
            return {"world_size": self.world_size}
        first, since = self.chunk_base
        begun = -(-(step - since) // self.steps_per_chunk)  # turns whose chunks were read
        return {
            "world_size": self.world_size,
            "chunk_base": [first, since],
            "next_chunk": first + begun * self.world_size,
        }

    def _base_after(self, step: int, saved: Mapping[str, Any]) -> tuple[int, int]:
        """The same turns as before on the same number of ranks; on another number, fresh
        turns from the first chunk no rank had begun (the rest of a turn that was cut short
        mid-way is not read again, and no chunk is skipped). A checkpoint written before the
        counter ran past one round holds a chunk below n_chunks: a place in round 0."""
        if saved.get("world_size", 1) == self.world_size and "chunk_base" in saved:
            first, since = saved["chunk_base"]
            return int(first), int(since)
        if "next_chunk" in saved:
            return int(saved["next_chunk"]), step
        return 0, 0

    def advance(self, step: int) -> None:
        """Call before step ``step`` is sampled (outside any captured graph): switches to
        the next chunk when its turn has come. Costs nothing while the corpus fits."""
        if self.n_chunks > 1 and self.chunk_of(step) != self.chunk:
            started, uploaded = time.perf_counter(), self._uploaded
            self._activate(self.chunk_of(step))
            self._turns += 1
            self._turn_seconds += time.perf_counter() - started
            self._turn_bytes += self._uploaded - uploaded

    def turn_stats(self) -> dict[str, Any] | None:
        """What the chunk turns of this run have cost so far, on this rank (None while the
        corpus is resident): ``turns``, the host ``seconds`` ``advance`` spent in them, and
        the ``bytes`` read for them (each turn starts the next chunk's upload). The uploads
        at start-up and at ``set_step`` are not turns."""
        if self.n_chunks == 1:
            return None
        return {
            "turns": self._turns,
            "seconds": self._turn_seconds,
            "bytes": self._turn_bytes,
            "n_chunks": self.n_chunks,
            "piece_tokens": self.piece_tokens,
        }

    def _activate(self, chunk: int) -> None:
        if chunk == self.chunk:
            return
        stream = self.device.current_stream()
        if self._staged is not None and self._staged_chunk == chunk:
            stream.wait_event(self._staged_ready)  # the upload ran while we trained
            self._active[: self._staged.numel()].copy_(self._staged)
        else:
            self._upload(chunk, self._active)
        # On the stream, so after the last step's draws read the old count.
        self.n_starts.fill_(self._starts_in(chunk))
        self.chunk = chunk
        if self._staged is not None:
            done = self.device.new_event()
            done.record(stream)  # the staged buffer is free once the copy above has run
            self._copy_stream.wait_event(done)
            self._staged_chunk = chunk + self.world_size  # this rank's chunk of the next turn
            self._staged_ready = self._upload(self._staged_chunk, self._staged, self._copy_stream)

    def _cut_pieces(self, total: int, capacity: int) -> None:
        """Cut the corpus (``total`` tokens) into pieces, and the pieces into chunks of at most
        ``capacity`` tokens: about PIECES_PER_CHUNK pieces a chunk, each at least
        MIN_PIECE_WINDOWS windows long where a chunk can hold that."""
        smallest = MIN_PIECE_WINDOWS * self.window
        self.piece_tokens = min(capacity, max(smallest, -(-capacity // PIECES_PER_CHUNK)))
        # The corpus's tail shorter than a window is no piece: no window could start in it.
        whole, tail = divmod(total, self.piece_tokens)
        self.n_pieces = max(1, whole + (tail >= self.window))
        self.n_chunks = math.ceil(self.n_pieces / (capacity // self.piece_tokens))
        self.pieces_per_chunk = math.ceil(self.n_pieces / self.n_chunks)  # the most a chunk holds
        self.chunk_tokens = self.pieces_per_chunk * self.piece_tokens

    def _round_order(self, round_: int) -> np.ndarray:
        """Round ``round_``'s order of the pieces: (n_pieces,) int64, drawn from (seed, round)
        alone, so every rank (and a resumed run) finds the same one."""
        if round_ not in self._orders:
            if len(self._orders) >= 2:  # the active chunk's round and the staged one's
                self._orders.pop(min(self._orders))
            generator = np.random.default_rng([self.seed & ((1 << 64) - 1), round_])
            self._orders[round_] = generator.permutation(self.n_pieces)
        return self._orders[round_]

    def _spans(self, chunk: int) -> list[tuple[int, int]]:
        """(first token in the corpus, length) of the runs of tokens ``chunk`` holds, in the
        order they lie end to end in the buffer: the slice, or the chunk's pieces with the
        neighbours in the corpus joined into one run (one read)."""
        if self.n_chunks == 1:
            return [(self._first, self._last - self._first)]
        spans: list[tuple[int, int]] = []
        for piece in self.chunk_pieces(chunk).tolist():
            start = piece * self.piece_tokens
            length = min(self.piece_tokens, self._last - start)
            if spans and sum(spans[-1]) == start:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            else:
                spans.append((start, length))
        return spans

    def _starts_in(self, chunk: int) -> int:
        """Window starts in ``chunk``: those of each piece (none across two)."""
        if self.n_chunks == 1:
            return self._last - self._first - self.window + 1
        pieces = self.chunk_pieces(chunk)
        lengths = np.minimum(self.piece_tokens, self._last - pieces * self.piece_tokens)
        return int(np.maximum(0, lengths - self.window + 1).sum())

    def _device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device.torch)

    def _managed_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from gpuflow.device.managed import managed_empty

        return managed_empty(numel, dtype, self.device)

    def _upload(self, chunk: int, target: torch.Tensor, stream: Any = None) -> Any:
        """Copy ``chunk``'s tokens into ``target``, end to end, through pinned buffers or
        kvikio, on ``stream`` (default: the current one). Returns the event of its last copy."""
        stream = stream or self.device.current_stream()
        spans = self._spans(chunk)
        length = sum(n for _, n in spans)
        if self._starts_in(chunk) < 1:
            raise GpuflowError(
                f"chunk {chunk} of the corpus holds {length} tokens, fewer than one window "
                f"({self.window}); raise the device-memory budget"
            )
        itemsize = self.token_dtype.itemsize
        per_copy = (KVIKIO_REQUEST_BYTES if self._kvikio else UPLOAD_CHUNK_BYTES) // itemsize
        done = self.device.new_event()
        reads = list(self._reads(spans, per_copy))
        self._uploaded += length * itemsize
        bar = progress_bar(counter=DownloadColumn()) if self._show_progress else None
        task = bar.add_task("uploading tokens", total=length * itemsize) if bar else None
        if bar:
            bar.start()
        try:
            with self.device.use_stream(stream):
                if self._kvikio is not None:
                    # kvikio writes the buffer as soon as it is asked, outside any stream: the
                    # host first waits for the work queued on ``stream`` (earlier readers of
                    # ``target``, and the copy out of the staged buffer ``_activate`` queued).
                    stream.synchronize()
                for group in _groups(reads, per_copy):
                    into, end = group[0][1], group[-1][1] + group[-1][3] - group[-1][2]
                    files = [
                        (s.path, HEADER_BYTES + lo * itemsize, hi - lo) for s, _, lo, hi in group
                    ]
                    self._read_group(files, target[into:end], stream)
                    for shard, first, last in _by_shard(group):
                        self._ids.note(shard.path, target[first:last])
                    if bar:
                        bar.update(task, advance=(end - into) * itemsize)
                self._ids.check()
                if self.managed:  # the pages the copies wrote, to the device
                    from gpuflow.device.managed import prefetch_to_device

                    prefetch_to_device(target[:length])
                done.record(stream)
        finally:
            if bar:
                bar.stop()
        return done

    def _read_group(
        self, reads: Sequence[tuple[Path, int, int]], piece: torch.Tensor, stream: Any
    ) -> None:
        """``reads`` (path, byte offset, tokens), end to end, into ``piece``: each by kvikio,
        or all read into one pinned buffer by several threads at once and copied from there
        on ``stream`` by one copy (while the next group is read into the pool's other
        buffer). A chunk of many short pieces so costs one wait and one copy, not one each."""
        if self._kvikio is not None:
            into = 0
            for path, offset, n in reads:
                self._kvikio.read(path, offset, piece[into : into + n])
                into += n
            return
        host = self._pool.acquire(piece.nbytes, timeout=None)
        staged = host.bytes[: piece.nbytes].numpy()  # (nbytes,) uint8, pinned
        itemsize, requests, into = piece.element_size(), [], 0
        for path, offset, n in reads:
            requests.append((path, offset, staged[into * itemsize : (into + n) * itemsize]))
            into += n
        self._host_reader.read_many(requests)
        piece.copy_(host.bytes[: piece.nbytes].view(piece.dtype), non_blocking=True)
        copied = self.device.new_event()
        copied.record(stream)
        self._pool.release(host, after=copied)

    def _reads(self, spans: Sequence[tuple[int, int]], per_copy: int) -> Iterator[Read]:
        """The reads that put ``spans`` (first token in the corpus, length) end to end in a
        buffer: (shard, offset in the buffer, first token, end token in the shard), each of
        at most ``per_copy`` tokens of one shard (a span may run on into the next shard)."""
        into = 0
        for start, length in spans:
            end = start + length
            index = bisect_right(self._shard_starts, start) - 1  # the shard ``start`` is in
            while start < end:
                shard, base = self._shards[index], self._shard_starts[index]
                stop = min(end, base + shard.n_tokens)
                for lo in range(start, stop, per_copy):
                    hi = min(stop, lo + per_copy)
                    yield shard, into, lo - base, hi - base
                    into += hi - lo
                start, index = stop, index + 1

    @property
    def nbytes(self) -> int:
        return self._active.nbytes + (self._staged.nbytes if self._staged is not None else 0)

    def close(self) -> None:
        self.device.synchronize()
        self._pool.close()
        for reader in (self._kvikio, self._host_reader):
            if reader is not None:
                reader.close()


def _groups(reads: Sequence[Read], per_copy: int) -> Iterator[list[Read]]:
    """Runs of consecutive ``reads`` (laid end to end in the buffer) of at most ``per_copy``
    tokens in all: each run is one copy of the pinned path."""
    group: list[Read] = []
    size = 0
    for read in reads:
        n = read[3] - read[2]
        if group and size + n > per_copy:
            yield group
            group, size = [], 0
        group.append(read)
        size += n
    if group:
        yield group


def _by_shard(group: Sequence[Read]) -> Iterator[tuple[Shard, int, int]]:
    """(shard, first, end offset in the buffer) of each run of ``group``'s reads that come
    from one shard: the id check's parts."""
    for shard, run in itertools.groupby(group, key=lambda read: read[0]):
        run = list(run)
        yield shard, run[0][1], run[-1][1] + run[-1][3] - run[-1][2]


class _IdCheck:
    """The largest id of each shard, found on the device as its pieces arrive and checked
    against ``vocab_size`` once per upload (one wait). Nothing without a ``vocab_size``."""

    def __init__(self, vocab_size: int | None, itemsize: int) -> None:
        self.vocab_size = vocab_size
        self._wide = torch.int32 if itemsize == 2 else torch.int64  # holds every unsigned id
        self._mask = (1 << (8 * itemsize)) - 1
        self._per_part = UPLOAD_CHUNK_BYTES // itemsize  # bounds the widened copy below
        self._largest: dict[Path, list[torch.Tensor]] = {}

    def note(self, shard: Path, piece: torch.Tensor) -> None:
        if self.vocab_size is None:
            return
        for part in piece.split(self._per_part):
            wide = part.to(self._wide) & self._mask  # (n,) the ids as unsigned values
            self._largest.setdefault(shard, []).append(wide.max())

    def check(self) -> None:
        largest, self._largest = self._largest, {}
        for shard, maxima in largest.items():
            check_ids(shard, int(torch.stack(maxima).max()), self.vocab_size)


def default_budget(device: Device) -> int:
    """Half the device's free memory (everything the host has on the cpu)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device.torch)
        return free // 2
    return 1 << 62
