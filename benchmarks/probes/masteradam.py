"""Probe: bf16 weights with fp32 masters, updated by one Triton AdamW kernel.

main: the trainer's step (fp32 weights under bf16 autocast, get_total_norm + fused AdamW);
master: the model's weights in bf16, views into one flat bf16 buffer. The optimizer keeps
fp32 masters and both moments in flat buffers and updates them in one kernel that reads each
bf16 gradient where autograd left it (through a table of their addresses: the addresses
a captured step's gradients get are the ones every replay uses, so the table is filled once,
after the capture), applies the clip's factor, and writes the bf16 copy the next forward
reads. What it would save: the weights' casts in forward and backward, half the norm's
reading, and whatever the flat kernel gains over fused AdamW's multi-tensor launches.

PYTHONPATH=src python3 benchmarks/probes/masteradam.py check
    one optimizer against torch's AdamW on the same gradients (also on the cpu with
    TRITON_INTERPRET=1)
PYTHONPATH=src python3 benchmarks/probes/masteradam.py PRESET [out.json] [rounds]
    main and master alternating, resident-graph, compiled
"""

import sys
import tempfile

import torch
import triton
import triton.language as tl

from gpuflow.train.capture import CapturedStep
from gpuflow.train.config import TrainConfig
from gpuflow.train.optim import decay_groups
from gpuflow.train.trainer import Trainer

BLOCK = 4096  # elements per program


@triton.jit
def _master_adamw(
    grad_addrs,  # (n_tensors,) int64: where each bf16 gradient lies
    block_tensor,  # (n_blocks,) int32: the tensor a program updates
    block_start,  # (n_blocks,) int64: its first element within that tensor
    tensor_offset,  # (n_tensors,) int64: the tensor's place in the flat buffers
    tensor_numel,  # (n_tensors,) int64
    tensor_decay,  # (n_tensors,) fp32: weight decay
    master,  # (N,) fp32
    exp_avg,  # (N,) fp32
    exp_avg_sq,  # (N,) fp32
    weights,  # (N,) bf16: what the model's parameters are views of
    lr_ptr,  # () fp32
    step_ptr,  # () fp32, already counting this step
    scale_ptr,  # () the clip's divisor, >= 1
    beta1,
    beta2,
    eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    idx = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = idx < tl.load(tensor_numel + t)
    flat = tl.load(tensor_offset + t) + idx
    grad_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(tl.bfloat16))
    g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = g / tl.load(scale_ptr).to(tl.float32)
    w = tl.load(master + flat, mask=mask)
    m = tl.load(exp_avg + flat, mask=mask)
    v = tl.load(exp_avg_sq + flat, mask=mask)
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    w = w * (1.0 - lr * tl.load(tensor_decay + t))
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias2 = 1.0 - tl.exp(step * tl.log(beta2))
    w = w - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
    tl.store(master + flat, w, mask=mask)
    tl.store(exp_avg + flat, m, mask=mask)
    tl.store(exp_avg_sq + flat, v, mask=mask)
    tl.store(weights + flat, w.to(tl.bfloat16), mask=mask)


LIVE: list["MasterAdamW"] = []  # optimizers whose address table a capture must fill


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters with fp32 masters; decay on matrices only, as the trainer's."""

    def __init__(self, params: list[torch.nn.Parameter], config: TrainConfig) -> None:
        defaults = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=1e-8, fused=True)
        super().__init__(decay_groups(params, config.weight_decay), defaults)
        ordered = [p for g in self.param_groups for p in g["params"]]
        numels = [p.numel() for p in ordered]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        device = ordered[0].device
        self.master = torch.cat([p.detach().float().flatten() for p in ordered])  # (N,)
        self.weights = self.master.to(torch.bfloat16)  # (N,)
        with torch.no_grad():
            for p, offset, n in zip(ordered, offsets, numels, strict=True):
                p.data = self.weights[offset : offset + n].view(p.shape)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = torch.zeros((), device=device)
        self.grad_scale: torch.Tensor | None = None
        self._one = torch.ones((), device=device)
        self._lr = torch.zeros((), device=device)
        blocks = [(t, s) for t, n in enumerate(numels) for s in range(0, n, BLOCK)]
        self.block_tensor = torch.tensor([t for t, _ in blocks], dtype=torch.int32, device=device)
        self.block_start = torch.tensor([s for _, s in blocks], dtype=torch.int64, device=device)
        self.tensor_offset = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.tensor_numel = torch.tensor(numels, dtype=torch.int64, device=device)
        decay = [g["weight_decay"] for g in self.param_groups for _ in g["params"]]
        self.tensor_decay = torch.tensor(decay, dtype=torch.float32, device=device)
        self.grad_addrs = torch.zeros(len(ordered), dtype=torch.int64, device=device)
        self._ordered = ordered
        self._captured_addrs: list[int] | None = None
        LIVE.append(self)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        addrs = [p.grad.data_ptr() for p in self._ordered]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._captured_addrs = addrs  # the replays' addresses: filled after the capture
        else:
            self.grad_addrs.copy_(torch.tensor(addrs, dtype=torch.int64))
        lr = self.param_groups[0]["lr"]
        if not isinstance(lr, torch.Tensor):
            lr = self._lr.fill_(lr)
        beta1, beta2 = self.defaults["betas"]
        self.step_count.add_(1)
        _master_adamw[(len(self.block_tensor),)](
            self.grad_addrs,
            self.block_tensor,
            self.block_start,
            self.tensor_offset,
            self.tensor_numel,
            self.tensor_decay,
            self.master,
            self.exp_avg,
            self.exp_avg_sq,
            self.weights,
            lr,
            self.step_count,
            self.grad_scale if self.grad_scale is not None else self._one,
            beta1,
            beta2,
            self.defaults["eps"],
            BLOCK=BLOCK,
        )

    def after_capture(self) -> None:
        if self._captured_addrs is not None:
            self.grad_addrs.copy_(torch.tensor(self._captured_addrs, dtype=torch.int64))


def check(device: str) -> dict:
    """Three steps of MasterAdamW against torch's AdamW from the same fp32 values, fed the same
    bf16-valued gradients and clip factor; returns the largest differences."""
    config = TrainConfig()
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 64), (64,), (5000,), (7, 9)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(3)]
    ours = [torch.nn.Parameter(x.clone().to(device)) for x in start]
    reference = [torch.nn.Parameter(x.clone().to(device)) for x in start]
    opt = MasterAdamW(ours, config)
    ref = torch.optim.AdamW(
        decay_groups(reference, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=1e-8,
    )
    scale = torch.tensor(1.7, device=device)
    for step_grads in grads:
        for p, q, grad in zip(ours, reference, step_grads, strict=True):
            p.grad = grad.to(device)
            q.grad = grad.float().to(device) / scale
        opt.grad_scale = scale
        opt.step()
        ref.step()
    order = [p for grp in opt.param_groups for p in grp["params"]]
    masters = opt.master.split([p.numel() for p in order])
    by_id = {id(p): m.view(p.shape) for p, m in zip(order, masters, strict=True)}
    master_err = max(
        ((by_id[id(p)] - q.detach()).abs().max() / q.detach().abs().max()).item()
        for p, q in zip(ours, reference, strict=True)
    )
    copy_err = max(
        ((p.detach().float() - by_id[id(p)]).abs() / by_id[id(p)].abs()).max().item() for p in ours
    )
    return {"master_vs_adamw_rel": master_err, "bf16_copy_vs_master_rel": copy_err}


def master_build(self, resume):
    latest = plain_build(self, resume)
    self.optimizer = MasterAdamW([p for p in self.model.parameters()], self.config.train)
    return latest


def capture_then_fill(self):
    plain_capture(self)
    for opt in LIVE:
        opt.after_capture()


plain_build = Trainer.build
plain_capture = CapturedStep.capture

if __name__ == "__main__":
    if sys.argv[1] == "check":
        result = check("cuda" if torch.cuda.is_available() else "cpu")
        print(result)
        # the copy is the master in bf16 (rounded to nearest on the GPU, truncated by the cpu
        # interpreter): within one bf16 step, 2^-7 of the value, either way
        assert result["master_vs_adamw_rel"] < 1e-5 and result["bf16_copy_vs_master_rel"] <= 2**-7
        sys.exit(0)

    from abrows import measure_row

    from gpuflow.device import Device
    from gpuflow.train.config import resolve_config

    preset = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else None
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    config = resolve_config(preset, None, ["train.steps=200"])
    device = Device.resolve("auto")
    CapturedStep.capture = capture_then_fill
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            for label in ("main", "master"):
                Trainer.build = master_build if label == "master" else plain_build
                LIVE.clear()
                measure_row(config, device, label, r, scratch, rows, out, {"preset": preset})
