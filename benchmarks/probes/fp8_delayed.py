"""Probe: a compiled 6-layer GPT's forward+backward time with the blocks' FP8 products scaled
now (amax of each operand taken before its cast), with scales from the step before (delayed),
and with the transposed FP8 copies written by the cast itself; bf16 beside them.

python benchmarks/probes/fp8_delayed.py 350|1558|tiny [variants...]
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from gpuflow.model import fp8
from gpuflow.model.gpt import GPT, ModelConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F4, F5 = torch.finfo(E4M3).max, torch.finfo(E5M2).max
HISTORY = 16
torch._dynamo.config.recompile_limit = 64


def cast(t, scale, dtype):
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def amax(t):
    return t.detach().abs().amax().float().clamp(min=fp8.MIN_AMAX)


def push(hist, value):
    hist.copy_(torch.cat([value.view(1), hist[:-1]]))


class Product(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, xq, xq_col, x_inv, wq, wq_col, w_inv, g_hist, flags):
        ctx.save_for_backward(xq_col, x_inv, wq_col, w_inv, g_hist)
        ctx.flags, ctx.w_dtype = flags, w.dtype
        return torch._scaled_mm(
            xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True
        )

    @staticmethod
    def backward(ctx, grad):
        xq_col, x_inv, wq_col, w_inv, g_hist = ctx.saved_tensors
        delayed, fused_t = ctx.flags
        grad = grad.contiguous()  # (M, N)
        if delayed:
            scale = F5 / g_hist.amax().clamp(min=fp8.MIN_AMAX)
            push(g_hist, amax(grad))
        else:
            scale = F5 / amax(grad)
        gq = cast(grad, scale, E5M2)  # (M, N)
        gq_t = cast(grad.t(), scale, E5M2).contiguous() if fused_t else gq.t().contiguous()
        g_inv = scale.reciprocal()
        grad_x = torch._scaled_mm(gq, wq_col, scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(gq_t, xq_col, scale_a=g_inv, scale_b=x_inv, out_dtype=grad.dtype)
        return grad_x, grad_w.to(ctx.w_dtype), *([None] * 8)


class Linear(nn.Linear):
    flags = (False, False)

    def setup(self):
        for name in ("x_hist", "w_hist", "g_hist"):
            start = torch.full((HISTORY,), fp8.MIN_AMAX, device=self.weight.device)
            self.register_buffer(name, start, persistent=False)

    def forward(self, x):
        if not torch.is_grad_enabled():
            return F.linear(x, self.weight)
        delayed, fused_t = self.flags
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.to(dt).reshape(-1, x.shape[-1])  # (M, K)
            w = self.weight.to(dt)  # (N, K)
            xd, wd = x2.detach(), w.detach()
            if delayed:
                xs = F4 / self.x_hist.amax().clamp(min=fp8.MIN_AMAX)
                ws = F4 / self.w_hist.amax().clamp(min=fp8.MIN_AMAX)
                push(self.x_hist, amax(xd))
                push(self.w_hist, amax(wd))
            else:
                xs, ws = F4 / amax(xd), F4 / amax(wd)
            xq = cast(xd, xs, E4M3)
            xq_col = cast(xd.t(), xs, E4M3).contiguous().t() if fused_t else xq.t().contiguous().t()
            wq = cast(wd, ws, E4M3)
            wq_col = cast(wd.t(), ws, E4M3).contiguous().t() if fused_t else wq.t().contiguous().t()
            xi, wi = xs.reciprocal(), ws.reciprocal()
            y = Product.apply(x2, w, xq, xq_col, xi, wq, wq_col, wi, self.g_hist, self.flags)
        return y.view(*x.shape[:-1], w.shape[0])


def build(mode, shape, device):
    torch.manual_seed(0)
    n_layer, n_head, d, _, vocab, ctx = shape
    model = GPT(ModelConfig(vocab, n_layer, n_head, d, ctx)).to(device).to(torch.bfloat16)
    if mode == "now":
        fp8.use_fp8_products(model)
    elif mode != "bf16":
        for m in model.modules():
            if type(m) is nn.Linear and m.bias is None:
                m.__class__ = Linear
                m.setup()
                m.flags = {"del": (True, False), "dynT": (False, True), "delT": (True, True)}[mode]
    return model


def run(mode, shape, device, steps):
    torch._dynamo.reset()
    model = build(mode, shape, device)
    f = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    batch, vocab, ctx = shape[3], shape[4], shape[5]
    xs = [torch.randint(0, vocab, (batch, ctx), generator=g).to(device) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    losses = []

    def step(i):
        with torch.autocast(device, torch.bfloat16):
            loss = f(xs[i % 4], xs[i % 4])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    for i in range(4):
        losses.append(float(step(i)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    sync()
    ms = (time.perf_counter() - t0) / steps * 1000
    losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    shown = [round(v, 4) for v in losses]
    print(f"{mode:5s} {ms:8.2f} ms/step  peak {peak} GB  losses {shown}", flush=True)
    return {"ms_per_step": ms, "peak_gb": peak, "losses": losses}


if __name__ == "__main__":
    which = sys.argv[1]
    shape = {
        "350": (6, 16, 1024, 64, 50304, 1024),
        "1558": (6, 25, 1600, 32, 50304, 1024),
        "tiny": (2, 2, 64, 4, 512, 64),
    }[which]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = sys.argv[2:] or ["bf16", "now", "del", "dynT", "delT"]
    steps = 20 if device == "cuda" else 2
    out = {m: run(m, shape, device, steps) for m in modes}
    with open(os.environ.get("OUT", ".") + f"/fp8_delayed_{which}.json", "w") as fh:
        json.dump({"shape": shape, "rows": out}, fh, indent=1)
