"""Where the ranks of one host meet inside the step: a kernel on flags in memory every rank
maps (``train/peer_memory.py``), in place of an NCCL all-reduce made only to meet.

Each rank writes the meet's count into its slot of every other rank's flags, then waits until
every other rank's slot in its own flags has reached the count. Nothing is reset: a count
only grows, so a meet needs one write per peer and no read-modify-write over the link. A rank
that died or stopped answering would keep the others waiting on the GPU, where nothing the
host does to NCCL reaches; so the wait also watches a word in pinned host memory, and leaving
the job (``distributed.abort``, when a host collective finds a rank gone) sets it
(``end_waits``): the wait ends, as NCCL's does when aborted. A meet can carry a few numbers
and hand back their sum (the clip's norm and the loss), each rank writing its own into a row
of every rank's slots before it signals. Why the step meets here and not at NCCL:
docs/decisions/049.
"""

from __future__ import annotations

import torch

from gpuflow.train.peer_memory import SharedBuffer

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

# A step's meets: after the gradients are pushed, after the weights are written, and the sum
# of the norm's and the loss's parts (which also meets after every rank has read its rows).
SUMS = 2  # the channel of the meet that sums values; those below it carry nothing
CHANNELS = 3
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
        slots,  # (W,) int64: each rank's value slots, (W * K,) fp32; row r rank r's values
        values,  # (K,) fp32: this rank's values in; their sum over the ranks out
        rank,
        channel,
        W: tl.constexpr,
        LANES: tl.constexpr,  # a power of two >= W: one rank a thread
        K: tl.constexpr,  # values carried (a power of two), or 0
        CHECK_EVERY: tl.constexpr,
    ):
        lanes = tl.arange(0, LANES)
        ranks = lanes < W
        peer = ranks & (lanes != rank)
        count = tl.load(counts + channel) + 1
        tl.store(counts + channel, count)
        if K > 0:  # this rank's values into its row of every rank's slots, its own included
            ks = tl.arange(0, K)
            mine = tl.load(values + ks)  # (K,)
            every = tl.load(slots + lanes, mask=ranks, other=0).to(tl.pointer_type(tl.float32))
            rows = every[:, None] + rank * K + ks[None, :]  # (LANES, K)
            tl.store(rows, mine[None, :] + tl.zeros([LANES, K], tl.float32), mask=ranks[:, None])
            tl.debug_barrier()  # every thread's writes before any flag says they are there
        theirs = tl.load(flags + lanes, mask=peer, other=0).to(tl.pointer_type(tl.int32))
        # release: what this rank wrote before (earlier kernels, and the values above) is seen
        # by whoever sees this
        tl.atomic_xchg(theirs + channel * W + rank, count, mask=peer, sem="release", scope="sys")
        own = tl.load(flags + rank).to(tl.pointer_type(tl.int32))
        waits = own + channel * W + lanes
        seen = tl.atomic_add(waits, 0, mask=peer, sem="acquire", scope="sys")
        behind = tl.sum(tl.where(peer & (seen < count), 1, 0))
        abort = abort_addr.to(tl.pointer_type(tl.int32))
        stop = tl.load(abort, volatile=True)
        rounds = 0
        while (behind > 0) & (stop == 0):
            seen = tl.atomic_add(waits, 0, mask=peer, sem="acquire", scope="sys")
            behind = tl.sum(tl.where(peer & (seen < count), 1, 0))
            rounds += 1
            if rounds % CHECK_EVERY == 0:
                stop = tl.load(abort, volatile=True)
        if K > 0:  # the rows summed in one fixed order: the same bits on every rank
            tl.debug_barrier()
            kept = tl.load(slots + rank).to(tl.pointer_type(tl.float32))
            got = tl.load(kept + lanes[:, None] * K + ks[None, :], mask=ranks[:, None], other=0.0,
                          volatile=True)  # fmt: skip
            tl.store(values + ks, tl.sum(got, axis=0))


def end_waits() -> None:
    """End every meet this process waits at, now and later: for leaving the job."""
    if _abort_word is not None:
        _abort_word.fill_(1)


class PeerMeet:
    """``meet(channel)`` queues this rank's meet on ``channel`` with every other rank of the
    default group; ``sum_(values)`` one that also sums ``values`` over the ranks, in place
    (as an all-reduce does). Every rank must queue the same meets in the same order. ``make``
    returns None where the GPUs cannot map each other's memory. Collective: every rank calls
    it."""

    def __init__(
        self, flags: SharedBuffer, slots: SharedBuffer, rank: int, world_size: int
    ) -> None:
        global _abort_word
        if _abort_word is None:
            _abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        _abort_word.fill_(0)
        self.rank, self.world_size = rank, world_size
        self.carries = slots.local.numel() // world_size  # values a sum_ takes
        device = flags.local.device
        self._buffers = (flags, slots)  # kept mapped while the tables point into them
        self._flags, self._slots = flags.copy_table, slots.copy_table  # by rank
        self._counts = torch.zeros(CHANNELS, dtype=torch.int32, device=device)
        self._no_values = torch.zeros(1, device=device)
        self._lanes = triton.next_power_of_2(world_size)

    @classmethod
    def make(
        cls, rank: int, world_size: int, device: torch.device, carries: int = 2
    ) -> PeerMeet | None:
        """Meets of the default group's ranks, whose ``sum_`` takes ``carries`` values (a
        power of two)."""
        if triton is None or carries & (carries - 1):
            return None
        flags = SharedBuffer.shared(CHANNELS * world_size, torch.int32, device)
        slots = SharedBuffer.shared(carries * world_size, torch.float32, device)
        return None if flags is None or slots is None else cls(flags, slots, rank, world_size)

    @property
    def bytes_per_meet(self) -> int:
        """What one meet writes into the other ranks' memory (a sum_, its values besides)."""
        return 4 * (self.world_size - 1)

    def __call__(self, channel: int) -> None:
        if not 0 <= channel < SUMS:
            raise ValueError(f"channel {channel}: want 0 <= channel < {SUMS}")
        self._launch(channel, self._no_values, 0)

    def sum_(self, values: torch.Tensor) -> None:
        """``values`` ((carries,) fp32 on this rank's device) summed over the ranks, in
        place, summed in one fixed order, so every rank holds the same bits."""
        if values.shape != (self.carries,) or values.dtype != torch.float32:
            raise ValueError(f"sum_ takes ({self.carries},) fp32, got {tuple(values.shape)} "
                             f"{values.dtype}")  # fmt: skip
        self._launch(SUMS, values, self.carries)

    def _launch(self, channel: int, values: torch.Tensor, carries: int) -> None:
        meet_kernel[(1,)](
            self._flags.tensor,
            self._counts,
            _abort_word.data_ptr(),
            self._slots.tensor,
            values,
            self.rank,
            channel,
            W=self.world_size,
            LANES=self._lanes,
            K=carries,
            CHECK_EVERY=_CHECK_EVERY,
            num_warps=max(1, self._lanes // 32),
        )
