"""AdamW over bf16 weights with fp32 masters: the captured step's optimizer on CUDA.

The weights the model sees are bf16 views into one flat buffer, the fp32 masters and both
moments live in flat buffers too, and one Triton kernel updates them all, reading each bf16
gradient where autograd left it (through a device table of addresses, filled once after a
capture: ``after_capture``). Checkpoints stay as plain AdamW writes them, so a run resumes on
any device and with either optimizer. Why, and what it saves: docs/architecture/training.md
(bf16 weights over fp32 masters).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gpuflow.common.sizes import round_up
from gpuflow.device.accelerator import Device
from gpuflow.train.peer_memory import SharedBuffer
from gpuflow.transfer.mirror import read_now
from gpuflow.transfer.upload import DeviceTable, upload_values

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

BLOCK = 4096  # elements per program
# How many fp32 elements gather_state moves through the device at once (256 MB).
GATHER_ELEMENTS = 1 << 26
ALIGN = 8  # each tensor's place in the flat buffers: a multiple of 8 elements (16 bf16 bytes)

if triton is not None:

    @triton.jit
    def _one_minus_exp(x):
        """1 - e^x for x <= 0. Near 0 the difference would cancel (and the GPU's fast exp is
        off by about 1e-7), so there a series stands in: its first omitted term, x^6/720, is
        below 2e-9 of the result for x > -0.1."""
        series = -x * (1.0 + x / 2.0 * (1.0 + x / 3.0 * (1.0 + x / 4.0 * (1.0 + x / 5.0))))
        return tl.where(x > -0.1, series, 1.0 - tl.exp(x))

    @triton.jit
    def _master_adamw_kernel(
        grad_addrs,  # (n_tensors,) int64: where each bf16 gradient lies
        block_tensor,  # (n_blocks,) int32: the tensor a program updates
        block_start,  # (n_blocks,) int64: its first element within that tensor
        block_end,  # (n_blocks,) int64: one past its last (a block may stop short of BLOCK)
        tensor_offset,  # (n_tensors,) int64: the tensor's place in the flat buffers
        tensor_decay,  # (n_tensors,) fp32: weight decay
        master,  # (N / world_size,) fp32: this rank's part, from flat element shard_lo
        exp_avg,  # (N / world_size,) fp32
        exp_avg_sq,  # (N / world_size,) fp32
        shard_lo,  # the part's first element in the flat buffers
        weights,  # (N,) bf16: what the model's parameters are views of
        peer_weights,  # (N_PEERS,) int64: where the other ranks' weights lie, to write too
        lr_ptr,  # () fp32
        step_ptr,  # () fp32, already counting this step
        scale_ptr,  # () the clip's divisor, >= 1
        beta1,
        beta2,
        one_minus_beta1,  # (from the host, in double precision: 1 - 0.999 in fp32 is 1e-5 off)
        one_minus_beta2,
        log_beta1,
        log_beta2,
        eps,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,  # sizes multiples of 8 and gradients 16-byte aligned
        N_PEERS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        end = tl.load(block_end + pid)
        offset = tl.multiple_of(tl.load(tensor_offset + t), 8)
        grad_addr = tl.load(grad_addrs + t)
        # Every block starts at a multiple of 8 elements (a shard's edge, too).
        start = tl.multiple_of(tl.load(block_start + pid), 8)
        if ALIGNED:
            # Without these Triton cannot prove a program's elements contiguous and aligned,
            # and loads them one at a time instead of in 16-byte vectors.
            end = tl.multiple_of(end, 8)
            grad_addr = tl.multiple_of(grad_addr, 16)
        idx = start + tl.arange(0, BLOCK)
        mask = idx < end
        flat = offset + idx
        local = flat - shard_lo  # where the part's own buffers hold the same elements
        grad = grad_addr.to(tl.pointer_type(tl.bfloat16))
        g = tl.load(grad + idx, mask=mask, other=0.0).to(tl.float32)
        g = g / tl.load(scale_ptr).to(tl.float32)
        w = tl.load(master + local, mask=mask)
        m = tl.load(exp_avg + local, mask=mask)
        v = tl.load(exp_avg_sq + local, mask=mask)
        lr = tl.load(lr_ptr)
        step = tl.load(step_ptr)
        w = w * (1.0 - lr * tl.load(tensor_decay + t))
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        bias1 = _one_minus_exp(step * log_beta1)  # 1 - beta1^step
        bias2 = _one_minus_exp(step * log_beta2)
        w = w - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
        tl.store(master + local, w, mask=mask)
        tl.store(exp_avg + local, m, mask=mask)
        tl.store(exp_avg_sq + local, v, mask=mask)
        w16 = w.to(tl.bfloat16)
        tl.store(weights + flat, w16, mask=mask)
        for j in tl.static_range(N_PEERS):  # over the link, into the other ranks' memory
            peer = tl.load(peer_weights + j).to(tl.pointer_type(tl.bfloat16))
            tl.store(peer + flat, w16, mask=mask)


class MasterAdamW(torch.optim.Optimizer):
    """Takes over ``adamw``'s parameters, hyper-parameters and moments; from then on the
    parameters are bf16 and this optimizer holds their fp32 values. Like fused AdamW it
    divides the gradients by ``grad_scale`` (the clip's factor) as it reads them.

    ``shard=(rank, world_size)``: the flat buffers are padded to ``world_size`` equal parts;
    this rank holds the fp32 masters and moments of part ``rank`` only (``shard_range``) and
    ``step`` updates that part alone, reading only that part of each gradient; the caller
    averages that part over the ranks first and gathers every rank's updated weights after
    (``train/sharded.py``). ``gather_state`` assembles the whole state on rank 0 for a
    checkpoint."""

    def __init__(self, adamw: torch.optim.Optimizer, shard: tuple[int, int] = (0, 1)) -> None:
        rank, world_size = shard
        if not 0 <= rank < world_size:
            raise ValueError(f"shard {shard}: want 0 <= rank < world_size")
        groups = [dict(g) for g in adamw.param_groups]
        for group in groups:
            group["fused"] = True
        super().__init__(groups, {**adamw.defaults, "fused": True})
        self._params = [p for g in self.param_groups for p in g["params"]]
        numels = [p.numel() for p in self._params]
        offsets, end = [], 0
        for n in numels:
            offsets.append(end)
            end += round_up(n, ALIGN)
        end = round_up(end, ALIGN * world_size)  # equal parts, each 16-byte aligned
        part = end // world_size
        lo, hi = self.shard_range = (rank * part, (rank + 1) * part)
        self.world_size = world_size
        self._views = [
            (o, n, p.shape) for o, n, p in zip(offsets, numels, self._params, strict=True)
        ]
        # Each tensor's part of the shard, in its own element numbers: [first, end).
        self._ranges = [
            (max(0, lo - o), min(n, hi - o)) for o, n in zip(offsets, numels, strict=True)
        ]
        device = self._params[0].device
        self.master = torch.zeros(part, device=device)  # (N / world_size,) fp32, from lo
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = torch.zeros((), device=device)
        # The whole masters and moments, (N,) fp32 each: the part's own buffers on one rank;
        # host copies gathered for a checkpoint on rank 0 of several (``gather_state``).
        self._whole: tuple[torch.Tensor, ...] | None = (
            (self.master, self.exp_avg, self.exp_avg_sq) if world_size == 1 else None
        )
        counters = []
        with torch.no_grad():
            self.weights = torch.zeros(end, dtype=torch.bfloat16, device=device)  # (N,)
            for i, p in enumerate(self._params):
                self._view(self.weights, i).copy_(p)
                moments = adamw.state.get(p, {})
                self._part_of(self.master, i).copy_(self._own(p, i))
                if "exp_avg" in moments:
                    self._part_of(self.exp_avg, i).copy_(self._own(moments["exp_avg"], i))
                    self._part_of(self.exp_avg_sq, i).copy_(self._own(moments["exp_avg_sq"], i))
                    counters.append(torch.as_tensor(moments["step"]).float().reshape(()))
            # AdamW counts steps per parameter; all its counters are read in one go.
            self.step_count.fill_(max(read_now(torch.stack(counters))) if counters else 0.0)
            for i, p in enumerate(self._params):
                p.data = self._view(self.weights, i)
        self.grad_scale: torch.Tensor | None = None
        self._one = torch.ones((), device=device)
        self._lr = torch.zeros((), device=device)

        blocks = [
            (t, s, min(s + BLOCK, last))
            for t, (first, last) in enumerate(self._ranges)
            for s in range(first, last, BLOCK)
        ]
        self._block_tensor = upload_values([t for t, _, _ in blocks], torch.int32, device)
        self._block_start = upload_values([s for _, s, _ in blocks], torch.int64, device)
        self._block_end = upload_values([e for _, _, e in blocks], torch.int64, device)
        self._offset = upload_values(offsets, torch.int64, device)
        decay = [float(g["weight_decay"]) for g in self.param_groups for _ in g["params"]]
        self._decay = upload_values(decay, torch.float32, device)
        # Rewritten only when the gradients move: each eager step, and once after a capture.
        self._grad_addrs = DeviceTable(len(numels), device)
        self._captured: list[int] | None = None
        self._sizes_aligned = all(n % ALIGN == 0 for n in numels)
        self._shared: SharedBuffer | None = None  # the weights, where every rank maps them

    def place_weights(self, buffer: torch.Tensor) -> None:
        """Move the bf16 weights into ``buffer`` (N,) (memory other ranks can write, say);
        the parameters become views of it."""
        if buffer.shape != self.weights.shape or buffer.dtype != self.weights.dtype:
            raise ValueError(f"the weights need a {tuple(self.weights.shape)} bf16 buffer")
        with torch.no_grad():
            buffer.copy_(self.weights)
            self.weights = buffer
            for i, p in enumerate(self._params):
                p.data = self._view(buffer, i)

    def share_weights(self, shared: SharedBuffer) -> None:
        """Move the bf16 weights into ``shared`` (a buffer every rank maps): from now on the
        kernel also writes this rank's part of the new weights into the other ranks' copies,
        so that no all-gather is needed; the caller makes the ranks meet after a step."""
        if len(shared.peers) != self.world_size - 1 or not self.runs_on(self.master.device):
            raise ValueError("peer writes need the CUDA kernel and every other rank's buffer")
        self.place_weights(shared.local)
        self._shared = shared

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters in ``param_groups`` order (the flat buffers' order)."""
        return self._params

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        """Whether the one-kernel update is available (else the step is plain torch code)."""
        return triton is not None and device.type == "cuda"

    def _view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s (in ``param_groups`` order) part of a flat buffer, shaped."""
        o, n, shape = self._views[index]
        return flat[o : o + n].view(shape)

    def _part_of(self, part: torch.Tensor, index: int) -> torch.Tensor:
        """The elements of parameter ``index`` that this rank's part holds, in a buffer of
        the part's (N / world_size,) layout (flattened; empty where the part has none)."""
        o = self._views[index][0] - self.shard_range[0]
        first, last = self._ranges[index]
        return part[o + first : o + max(first, last)]

    def _own(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's elements of ``tensor``, shaped as parameter ``index``, flattened."""
        first, last = self._ranges[index]
        return tensor.detach().flatten()[first : max(first, last)]

    def whole_state(self) -> tuple[torch.Tensor, ...]:
        """The masters and both moments, (N,) fp32 each, in the flat buffers' layout."""
        if self._whole is None:
            raise RuntimeError(
                "the optimizer state is split over the ranks: call gather_state() on every "
                "rank first; rank 0 then holds it whole"
            )
        return self._whole

    def master_of(self, index: int) -> torch.Tensor:
        """The fp32 value of parameter ``index``, a view (of the state gathered last, where
        it is split over ranks)."""
        return self._view(self.whole_state()[0], index)

    def full_precision_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with each parameter this optimizer holds at fp32."""
        index = {id(p): i for i, p in enumerate(self._params)}
        return {
            name: self.master_of(index[id(t)]) if id(t) in index else t.detach()
            for name, t in model.state_dict(keep_vars=True).items()
        }

    def gradient_buffer(
        self, flat: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A zeroed flat bf16 buffer laid out as the weights (so a rank's part of it holds
        the gradients of its part of the weights), and each parameter's view of it. ``flat``
        (N,) bf16, if given, is the buffer (memory other ranks can read, say)."""
        if flat is None:
            flat = torch.zeros_like(self.weights)  # (N,) bf16; the padding stays 0
        elif flat.shape != self.weights.shape or flat.dtype != self.weights.dtype:
            raise ValueError(f"the gradients need a {tuple(self.weights.shape)} bf16 buffer")
        else:
            flat.zero_()
        return flat, [self._view(flat, i) for i in range(len(self._params))]

    def use_device_lr(self, lr: torch.Tensor) -> None:
        for group in self.param_groups:
            group["lr"] = lr  # the kernel reads it from the device (its counters live there)

    @torch.no_grad()
    def gather_state(self) -> None:
        """Every rank's part of the masters and moments onto rank 0's host memory, so that
        rank 0 holds the whole state (before a checkpoint); the device takes no more than
        ``GATHER_ELEMENTS`` fp32 elements more meanwhile. Collective: all ranks call it."""
        if self.world_size == 1:
            return
        main = dist.get_rank() == 0
        parts = (self.master, self.exp_avg, self.exp_avg_sq)
        part = self.master.numel()
        if main and self._whole is None:
            self._whole = tuple(torch.empty(part * self.world_size) for _ in parts)
        chunk = max(ALIGN, GATHER_ELEMENTS // self.world_size)
        gathered = self.master.new_empty(self.world_size * min(chunk, part))
        for own, whole in zip(parts, self._whole or (None,) * len(parts), strict=True):
            for first in range(0, part, chunk):
                count = min(chunk, part - first)
                into = gathered[: self.world_size * count]  # (world_size * count,)
                dist.all_gather_into_tensor(into, own[first : first + count])
                if whole is not None:  # rank r's elements from r * part + first on
                    whole.view(self.world_size, part)[:, first : first + count].copy_(
                        into.view(self.world_size, count)
                    )

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        grads = [p.grad for p in self._params]
        if any(g is None for g in grads):
            raise RuntimeError("MasterAdamW updates every parameter; one has no gradient")
        lr = self.param_groups[0]["lr"]
        if not isinstance(lr, torch.Tensor):
            lr = self._lr.fill_(lr)
        scale = self.grad_scale if self.grad_scale is not None else self._one
        self.step_count.add_(1)
        if self.runs_on(self.master.device):
            self._launch(grads, lr, scale)
        else:
            self._reference_step(grads, lr, scale)

    def _launch(self, grads: list[torch.Tensor], lr: torch.Tensor, scale: torch.Tensor) -> None:
        addrs = [g.data_ptr() for g in grads]
        if torch.cuda.is_current_stream_capturing():
            self._captured = addrs  # a copy from the host cannot be captured: done after
        else:
            self._grad_addrs.write(addrs)
        if not len(self._block_tensor):  # a shard of padding only
            return
        beta1, beta2 = self.defaults["betas"]
        aligned = self._sizes_aligned and all(a % 16 == 0 for a in addrs)
        _master_adamw_kernel[(len(self._block_tensor),)](
            self._grad_addrs.tensor,
            self._block_tensor,
            self._block_start,
            self._block_end,
            self._offset,
            self._decay,
            self.master,
            self.exp_avg,
            self.exp_avg_sq,
            self.shard_range[0],
            self.weights,
            # (any int64 table where no rank shares the weights: N_PEERS=0 reads none of it)
            self._grad_addrs.tensor if self._shared is None else self._shared.peer_table.tensor,
            lr,
            self.step_count,
            scale,
            beta1,
            beta2,
            1.0 - beta1,
            1.0 - beta2,
            math.log(beta1),
            math.log(beta2),
            self.defaults["eps"],
            BLOCK=BLOCK,
            ALIGNED=aligned,
            N_PEERS=0 if self._shared is None else len(self._shared.peers),
        )

    def after_capture(self) -> None:
        """After a capture: point the table at the gradients' addresses in the graph."""
        if self._captured is not None:
            self._grad_addrs.write(self._captured)
            self._captured = None

    def _reference_step(
        self, grads: list[torch.Tensor], lr: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """The kernel's arithmetic in torch operations, one tensor at a time."""
        beta1, beta2 = self.defaults["betas"]
        step = self.step_count.double()  # in fp32, 1 - 0.999^1 would be 1e-5 off
        bias1 = (1 - beta1**step).float()
        bias2_sqrt = (1 - beta2**step).sqrt().float()
        for i, grad in enumerate(grads):
            first, last = self._ranges[i]
            if first >= last:
                continue
            g = self._own(grad, i).float() / scale
            parts = (self.master, self.exp_avg, self.exp_avg_sq)
            w, m, v = (self._part_of(part, i) for part in parts)
            w.mul_(1 - lr * self._decay[i])
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w.sub_(lr / bias1 * m / (v.sqrt() / bias2_sqrt + self.defaults["eps"]))
        lo, hi = self.shard_range
        self.weights[lo:hi].copy_(self.master)

    def state_dict(self) -> dict:
        """AdamW's layout: per-parameter ``step``, ``exp_avg`` and ``exp_avg_sq`` (fp32); where
        the state is split over ranks, rank 0's host copy as ``gather_state`` left it."""
        _, exp_avg, exp_avg_sq = self.whole_state()
        state = {
            i: {
                "step": self.step_count.clone(),
                "exp_avg": self._view(exp_avg, i),
                "exp_avg_sq": self._view(exp_avg_sq, i),
            }
            for i in range(len(self._params))
        }
        groups, start = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({**group, "params": list(range(start, start + count))})
            start += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError(
            "restore a checkpoint into torch's AdamW, then hand it to MasterAdamW"
        )


def with_fp32_masters(
    optimizer: torch.optim.Optimizer, device: Device, shard: tuple[int, int] = (0, 1)
) -> torch.optim.Optimizer:
    """``optimizer`` handed over to a MasterAdamW (updating part ``shard``) where its kernel
    runs and the step autocasts to bf16; otherwise, or if it already is one, ``optimizer``."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer
    if MasterAdamW.runs_on(device.torch) and device.supports_bf16_autocast:
        return MasterAdamW(optimizer, shard)
    return optimizer
