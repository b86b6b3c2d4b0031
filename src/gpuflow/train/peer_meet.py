"""Where the ranks of one host meet inside the step: a kernel on flags in memory every rank
maps (``train/peer_memory.py``), in place of an NCCL all-reduce made only to meet.

Each rank writes the meet's count into its slot of every other rank's flags, then waits until
every other rank's slot in its own flags has reached the count. Nothing is reset: a count
only grows, so a meet needs one write per peer and no read-modify-write over the link. A rank
that died or stopped answering would keep the others waiting on the GPU, where nothing the
host does to NCCL reaches; so the wait also watches a word in pinned host memory, and leaving
the job (``distributed.abort``, when a host collective finds a rank gone) sets it
(``end_waits``): the wait ends, as NCCL's does when aborted. Why the step meets here and not
at NCCL: docs/decisions/049.
"""

from __future__ import annotations

import torch

from gpuflow.train.peer_memory import SharedBuffer
from gpuflow.transfer.upload import DeviceTable

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

CHANNELS = 2  # meets a step: after the gradients are pushed, after the weights are written
_CHECK_EVERY = 256  # waiting rounds between looks at the host's word (a read over PCIe)

# The host's word: nonzero once this process has left its job. One a process, made on first
# use (pinned memory needs CUDA), cleared when a job's meets are made.
_abort_word: torch.Tensor | None = None

if triton is not None:

    @triton.jit
    def meet_kernel(
        flags,  # (W,) int64: each rank's flags, (CHANNELS * W,) int32; slot [c * W + r] rank r's
        counts,  # (CHANNELS,) int32: this rank's meets so far on each channel
        abort_addr,  # int64: the host's word (int32), readable from the device
        rank,
        channel,
        W: tl.constexpr,
        LANES: tl.constexpr,  # a power of two >= W: one rank a thread
        CHECK_EVERY: tl.constexpr,
    ):
        lanes = tl.arange(0, LANES)
        peer = (lanes < W) & (lanes != rank)
        count = tl.load(counts + channel) + 1
        tl.store(counts + channel, count)
        theirs = tl.load(flags + lanes, mask=peer, other=0).to(tl.pointer_type(tl.int32))
        # release: what this rank wrote before (earlier kernels) is seen by whoever sees this
        tl.atomic_xchg(theirs + channel * W + rank, count, mask=peer, sem="release", scope="sys")
        own = tl.load(flags + rank).to(tl.pointer_type(tl.int32))
        slots = own + channel * W + lanes
        seen = tl.atomic_add(slots, 0, mask=peer, sem="acquire", scope="sys")
        behind = tl.sum(tl.where(peer & (seen < count), 1, 0))
        abort = abort_addr.to(tl.pointer_type(tl.int32))
        stop = tl.load(abort, volatile=True)
        rounds = 0
        while (behind > 0) & (stop == 0):
            seen = tl.atomic_add(slots, 0, mask=peer, sem="acquire", scope="sys")
            behind = tl.sum(tl.where(peer & (seen < count), 1, 0))
            rounds += 1
            if rounds % CHECK_EVERY == 0:
                stop = tl.load(abort, volatile=True)


def end_waits() -> None:
    """End every meet this process waits at, now and later: for leaving the job."""
    if _abort_word is not None:
        _abort_word.fill_(1)


class PeerMeet:
    """``meet(channel)`` queues this rank's meet on ``channel`` with every other rank of the
    default group; every rank must queue the same meets in the same order. ``make`` returns
    None where the GPUs cannot map each other's memory. Collective: every rank calls it."""

    def __init__(self, flags: SharedBuffer, rank: int, world_size: int) -> None:
        global _abort_word
        if _abort_word is None:
            _abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        _abort_word.fill_(0)
        self.rank, self.world_size = rank, world_size
        self._flags = flags
        self._table = DeviceTable(world_size, flags.local.device)
        every = list(flags.peers)
        every.insert(rank, flags.local)
        self._table.write([t.data_ptr() for t in every])
        self._counts = torch.zeros(CHANNELS, dtype=torch.int32, device=flags.local.device)
        self._lanes = triton.next_power_of_2(world_size)

    @classmethod
    def make(cls, rank: int, world_size: int, device: torch.device) -> PeerMeet | None:
        if triton is None:
            return None
        flags = SharedBuffer.shared(CHANNELS * world_size, torch.int32, device)
        return None if flags is None else cls(flags, rank, world_size)

    @property
    def bytes_per_meet(self) -> int:
        """What one meet writes into the other ranks' memory."""
        return 4 * (self.world_size - 1)

    def __call__(self, channel: int) -> None:
        if not 0 <= channel < CHANNELS:
            raise ValueError(f"channel {channel}: want 0 <= channel < {CHANNELS}")
        meet_kernel[(1,)](
            self._table.tensor,
            self._counts,
            _abort_word.data_ptr(),
            self.rank,
            channel,
            W=self.world_size,
            LANES=self._lanes,
            CHECK_EVERY=_CHECK_EVERY,
            num_warps=max(1, self._lanes // 32),
        )
