"""``ResidentTokens``: the training corpus in device memory, batches drawn on the device.

    tokens = ResidentTokens(data.train, device, batch_size=32, seq_len=128, seed=1337)
    x, y = tokens.sample()        # (B, T) int64 each, on the device; no host work, no sync

The token shards cross the bus once, at start-up; after that a training step moves 0 bytes.
Sampling depends only on a step counter on the device (``set_step`` restores it); each of
``world_size`` ranks keeps its own slice of the corpus; a slice larger than ``budget_bytes``
streams through in chunks that take turns (``advance``).

How the shards are read and checked, how windows are drawn, and how chunks take turns:
docs/architecture/data.md (The resident corpus).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import DownloadColumn

from gpuflow.common.console import progress_bar
from gpuflow.common.errors import GpuflowError
from gpuflow.data.keyed import MASK32, STREAMS, hash32
from gpuflow.data.shards import HEADER_BYTES, Shard
from gpuflow.data.tokens import check_ids
from gpuflow.device.accelerator import Device
from gpuflow.transfer.diskread import HostFileReader, KvikioReader
from gpuflow.transfer.pinned import PinnedPool

UPLOAD_CHUNK_BYTES = 64 << 20
KVIKIO_REQUEST_BYTES = 1 << 30  # kvikio splits a request among its threads itself
_PROGRESS_MIN_BYTES = 256 << 20  # smaller corpora upload too fast for a bar to help
# (shard, offset in the chunk, first token, end token in the shard)
Piece = tuple[Shard, int, int, int]


def window_starts(
    seed: int, step: torch.Tensor, rows: torch.Tensor, n_starts: torch.Tensor
) -> torch.Tensor:
    """Start positions in [0, n_starts) for ``rows`` of batch ``step``: (B,) int64.

    A pure function of its inputs, so eager, captured and resumed runs draw the same windows.
    """
    key = (step * rows.numel() + rows) & MASK32  # (B,)
    base = hash32(torch.full_like(key, seed & MASK32) ^ STREAMS[0])
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
        self.device = Device.resolve(device)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        # Each rank its own draws: equal slices must not be read at the same offsets.
        self._draw_seed = seed if world_size == 1 else (seed + rank * STREAMS[1]) & MASK32
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
        if corpus_bytes <= self.budget_bytes:  # the slice stays resident
            self._first, self._last = first, last
            self.n_chunks, self.chunk_tokens = 1, last - first
        else:
            # The whole corpus streams through in chunks of equal size (half the budget at
            # most), which the ranks take in turn: world_size consecutive chunks per round.
            # The order does not depend on how many ranks there are, so a run resumed on
            # another number of them carries on where the last one stopped (``position``).
            self._first, self._last = 0, total
            self.n_chunks = math.ceil(total / max(self.window, self.budget_bytes // (2 * itemsize)))
            self.chunk_tokens = math.ceil(total / self.n_chunks)
        self.steps_per_chunk = max(1, self.chunk_tokens // (batch_size * seq_len))
        # (the chunk the first round of this run starts at, the step it starts at)
        self.chunk_base = (0, 0)
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
        index = starts[:, None] + self._offsets  # (B, T+1)
        windows = self._active[index].long() & self._id_mask  # (B, T+1) int64 token ids
        self.step += 1
        return windows[:, :-1], windows[:, 1:]

    # ---- position: host work between steps ------------------------------------------------

    def chunk_of(self, step: int) -> int:
        """The chunk this rank trains on at ``step``: its slice while that fits, else the
        round's ``rank``-th chunk."""
        if self.n_chunks == 1:
            return 0
        first, since = self.chunk_base
        rounds = (step - since) // self.steps_per_chunk
        return (first + rounds * self.world_size + self.rank) % self.n_chunks

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
        begun = -(-(step - since) // self.steps_per_chunk)  # rounds whose chunks were read
        return {
            "world_size": self.world_size,
            "chunk_base": [first, since],
            "next_chunk": (first + begun * self.world_size) % self.n_chunks,
        }

    def _base_after(self, step: int, saved: Mapping[str, Any]) -> tuple[int, int]:
        """The same rounds as before on the same number of ranks; on another number, fresh
        rounds from the first chunk no rank had begun (the rest of a round that was cut
        short mid-way is not read again, and no chunk is skipped)."""
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
            self._activate(self.chunk_of(step))

    def _activate(self, chunk: int) -> None:
        if chunk == self.chunk:
            return
        stream = self.device.current_stream()
        if self._staged is not None and self._staged_chunk == chunk:
            stream.wait_event(self._staged_ready)  # the upload ran while we trained
            self._active[: self._staged.numel()].copy_(self._staged)
        else:
            self._upload(chunk, self._active)
        self.n_starts.fill_(self._chunk_length(chunk) - self.window + 1)
        self.chunk = chunk
        if self._staged is not None:
            done = self.device.new_event()
            done.record(stream)  # the staged buffer is free once the copy above has run
            self._copy_stream.wait_event(done)
            self._staged_chunk = (chunk + self.world_size) % self.n_chunks  # the next round's
            self._staged_ready = self._upload(self._staged_chunk, self._staged, self._copy_stream)

    def _device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device.torch)

    def _managed_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from gpuflow.device.managed import managed_empty

        return managed_empty(numel, dtype, self.device)

    def _chunk_length(self, chunk: int) -> int:
        start = self._first + chunk * self.chunk_tokens
        return min(self.chunk_tokens, self._last - start)

    def _upload(self, chunk: int, target: torch.Tensor, stream: Any = None) -> Any:
        """Copy ``chunk`` of this rank's tokens into ``target`` through pinned buffers or
        kvikio, on ``stream`` (default: the current one). Returns the event of its last copy."""
        stream = stream or self.device.current_stream()
        start = self._first + chunk * self.chunk_tokens
        length = self._chunk_length(chunk)
        if length < self.window:
            raise GpuflowError(
                f"chunk {chunk} of the corpus holds {length} tokens, fewer than one window "
                f"({self.window}); raise the device-memory budget"
            )
        itemsize = self.token_dtype.itemsize
        per_copy = (KVIKIO_REQUEST_BYTES if self._kvikio else UPLOAD_CHUNK_BYTES) // itemsize
        done = self.device.new_event()
        pieces = list(self._pieces(start, length, per_copy))
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
                for shard, into, lo, hi in pieces:
                    piece = target[into : into + hi - lo]  # (n,)
                    self._read_piece(shard.path, HEADER_BYTES + lo * itemsize, piece, stream)
                    self._ids.note(shard.path, piece)
                    if bar:
                        bar.update(task, advance=piece.nbytes)
                self._ids.check()
                if self.managed:  # the pages the copies wrote, to the device
                    from gpuflow.device.managed import prefetch_to_device

                    prefetch_to_device(target[:length])
                done.record(stream)
        finally:
            if bar:
                bar.stop()
        return done

    def _read_piece(self, path: Path, offset: int, piece: torch.Tensor, stream: Any) -> None:
        """``piece.nbytes`` bytes of ``path`` from ``offset`` into ``piece``: by kvikio, or
        read into a pinned buffer by several threads and copied from there on ``stream``
        (while the next piece is read into the pool's other buffer)."""
        if self._kvikio is not None:
            self._kvikio.read(path, offset, piece)
            return
        host = self._pool.acquire(piece.nbytes, timeout=None)
        staged = host.bytes[: piece.nbytes]  # (nbytes,) uint8, pinned
        self._host_reader.read(path, offset, staged.numpy())
        piece.copy_(staged.view(piece.dtype), non_blocking=True)
        copied = self.device.new_event()
        copied.record(stream)
        self._pool.release(host, after=copied)

    def _pieces(self, start: int, length: int, per_copy: int) -> Iterator[Piece]:
        """(shard, offset in the chunk, first token, end token in the shard) pieces of at
        most ``per_copy`` tokens."""
        into = 0
        position = 0
        for shard in self._shards:
            lo, hi = position, position + shard.n_tokens
            position = hi
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            for piece in range(a, b, per_copy):
                end = min(b, piece + per_copy)
                yield shard, into, piece - lo, end - lo
                into += end - piece

    @property
    def nbytes(self) -> int:
        return self._active.nbytes + (self._staged.nbytes if self._staged is not None else 0)

    def close(self) -> None:
        self.device.synchronize()
        self._pool.close()
        for reader in (self._kvikio, self._host_reader):
            if reader is not None:
                reader.close()


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
