"""Buffers that every rank of a job maps, so that a kernel reads and writes the other ranks'
copies over the GPUs' link: torch's symmetric memory, on CUDA peer access between the GPUs of
one host.

The split update (``train/sharded.py``) uses two: the gradients, whose parts each rank writes
into the parts' owners' buffers, one row a rank, for the owner to average (in place of a
reduce-scatter), and the weights, which each rank's update kernel writes into every copy (in
place of an all-gather), all on the step's stream. Where one rank needs what another wrote,
the ranks meet at ``train/peer_meet.py``'s kernel, whose wait the job's abort ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpuflow.transfer.upload import DeviceTable

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

ROWS_BLOCK = 2048  # elements per program of the averaging kernel

if triton is not None:

    @triton.jit
    def rows_average_kernel(
        rows,  # (W * part,) bf16: row j holds rank j's gradients for this rank's part
        partial_sq,  # (n_programs,) fp32: each program's sum of squares of the mean
        start,  # this rank's row, where the mean is written: [start, start + part)
        part,
        W: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < part
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(W):
            total += tl.load(rows + j * part + offs, mask=mask, other=0.0).to(tl.float32)
        mean = (total / W).to(tl.bfloat16)
        tl.store(rows + start + offs, mean, mask=mask)
        m = mean.to(tl.float32)
        tl.store(partial_sq + pid, tl.sum(m * m, axis=0))


class SharedBuffer:
    """An (N,) device buffer that every rank of the default group allocates and maps.

    ``local`` is this rank's copy; ``copies`` every rank's, indexed by rank (``local`` among
    them), the others mapped into this process (tensors on this device); ``peers`` the
    others'. ``copy_table`` and ``peer_table`` hold their addresses for kernels.
    ``shared(...)`` makes one, or returns None where the GPUs cannot map each other's
    memory."""

    def __init__(self, local: torch.Tensor, handle: Any) -> None:
        self.local = local
        self._handle = handle  # keeps the other ranks' buffers mapped
        rank = handle.rank
        self.copies = [
            local if r == rank else handle.get_buffer(r, local.shape, local.dtype)
            for r in range(handle.world_size)
        ]
        self.peers = [copy for r, copy in enumerate(self.copies) if r != rank]
        self.copy_table = _address_table(self.copies, local.device)
        self.peer_table = _address_table(self.peers, local.device)

    @classmethod
    def shared(cls, numel: int, dtype: torch.dtype, device: torch.device) -> SharedBuffer | None:
        """A zeroed shared buffer of ``numel`` elements, zeroed on every rank before any rank
        returns. Collective: every rank calls it."""
        if device.type != "cuda" or triton is None or not dist.is_initialized():
            return None
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            symm_mem.enable_symm_mem_for_group(group)
            local = symm_mem.empty(numel, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(local, group)
        except (ImportError, AttributeError, RuntimeError):
            return None
        local.zero_()
        # A peer may write into this copy as soon as it leaves: the zeros must land first.
        torch.cuda.synchronize(device)
        dist.barrier()
        return cls(local, handle)


def _address_table(tensors: list[torch.Tensor], device: torch.device) -> DeviceTable:
    """A device table of ``tensors``' addresses, in order."""
    table = DeviceTable(len(tensors), device)
    table.write([t.data_ptr() for t in tensors])
    return table


class RowsAverage:
    """Averages this rank's part of the gradients from the rows the ranks pushed into its
    shared buffer (``buffer.local`` viewed as (world_size, part): row j from rank j, row
    ``rank`` this rank's own, which is where the flat layout keeps the part), in place in
    that row, and sums its squares (for the clip's norm). Every rank must have pushed when
    it runs, and none may push again until it has: the caller makes the ranks meet before
    and after it."""

    def __init__(self, buffer: SharedBuffer, rank: int, world_size: int) -> None:
        self.buffer, self.world_size = buffer, world_size
        self.part = buffer.local.numel() // world_size
        if self.part * world_size != buffer.local.numel():
            raise ValueError("the gradient buffer must split into equal rows")
        self.start = rank * self.part
        self._programs = triton.cdiv(self.part, ROWS_BLOCK)
        self._partial_sq = torch.zeros(self._programs, device=buffer.local.device)

    def __call__(self) -> torch.Tensor:
        """The part averaged; returns the sum of squares of the average, () fp32."""
        rows_average_kernel[(self._programs,)](
            self.buffer.local,
            self._partial_sq,
            self.start,
            self.part,
            W=self.world_size,
            BLOCK=ROWS_BLOCK,
        )
        return self._partial_sq.sum()
