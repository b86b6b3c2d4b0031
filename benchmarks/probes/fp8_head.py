"""Probe: the tied head's three products (logits, and the two gradient products the fused
cross-entropy runs in its forward) in bf16 as now, against FP8 variants, at gpt2-350m's and
gpt2-1558m's micro-batches. Times each part with CUDA events and measures each variant's
gradients against an fp32 reference. Prints JSON lines; writes them to argv[1] if given.

Variants:
  bf16      the head as it runs now (gpuflow.model.head's kernel, three bf16 products)
  bwd8      logits in bf16; the kernel also writes the gradient as e5m2 (a static scale:
            |grad| <= 1/N), both gradient products in FP8 (the weight's through a
            transposed copy of the gradient: cuBLAS's FP8 takes one layout)
  dh8       as bwd8, but only the hidden state's gradient in FP8 (no transposed copy)
  all8      bwd8 with the logits' product in FP8 too (e4m3 operands, the loss from them)
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from gpuflow.model.head import _softmax_grad_

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@triton.jit
def softmax_grad_rows_fp8(
    logits_ptr,
    targets_ptr,
    losses_ptr,
    out_ptr,
    stride,
    vocab,
    rows,
    out_scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    inv_rows = 1.0 / rows
    base = logits_ptr + row * stride
    out = out_ptr + row * stride
    target = tl.load(targets_ptr + row)
    target_logit = tl.load(base + target).to(tl.float32)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        g = grad * inv_rows
        tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)
        tl.store(out + cols, (g * out_scale).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(losses_ptr + row, lse - target_logit)


def quantise(t, dtype):
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * (fmax / amax)).clamp(-fmax, fmax).to(dtype), amax / fmax


def col_major(t):
    return t.t().contiguous().t()


class Timer:
    def __init__(self):
        self.parts: dict[str, float] = {}
        self.marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(self, name):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((name, e))

    def collect(self):
        torch.cuda.synchronize()
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            self.parts[name] = self.parts.get(name, 0.0) + a.elapsed_time(b)
        self.marks = []


def run(variant, h, w, y, t: Timer | None):
    n = h.shape[0]
    mark = t.mark if t else (lambda name: None)
    mark("start")
    if variant == "all8":
        hq, h_inv = quantise(h, E4M3)
        wq, w_inv = quantise(w, E4M3)
        mark("cast operands")
        logits = torch._scaled_mm(
            hq, wq.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    else:
        logits = h @ w.t()
    mark("logits product")
    if variant == "bf16":
        losses = _softmax_grad_(logits, y)
        mark("softmax gradient")
        gh = logits @ w
        mark("grad hidden product")
        gw = logits.t() @ h
        mark("grad weight product")
        return losses.mean(), gh, gw
    fmax = torch.finfo(E5M2).max
    g8 = torch.empty(logits.shape, dtype=E5M2, device=logits.device)
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    out_scale = n * fmax / 2  # |grad| <= 1/N, half the range for headroom
    softmax_grad_rows_fp8[(n,)](
        logits,
        y,
        losses,
        g8,
        logits.stride(0),
        logits.shape[1],
        n,
        out_scale,
        BLOCK=8192,
        num_warps=16,
    )
    g_inv = torch.tensor(1.0 / out_scale, device=h.device)
    mark("softmax gradient")
    if variant != "all8":
        wq, w_inv = quantise(w, E4M3)
    w_cm = col_major(wq)  # (V, C) by columns
    mark("cast weight")
    gh = torch._scaled_mm(g8, w_cm, scale_a=g_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
    mark("grad hidden product")
    if variant == "dh8":
        gw = logits.t() @ h
        mark("grad weight product")
        return losses.mean(), gh, gw
    gt = g8.t().contiguous()  # (V, N)
    mark("transpose gradient")
    hq2, h_inv2 = quantise(h, E4M3)
    h_cm = col_major(hq2)
    mark("cast hidden")
    gw = torch._scaled_mm(gt, h_cm, scale_a=g_inv, scale_b=h_inv2, out_dtype=torch.bfloat16)
    mark("grad weight product")
    return losses.mean(), gh, gw


def main():
    torch.manual_seed(0)
    rows = []
    for name, n, c in (("gpt2-350m", 64 * 1024, 1024), ("gpt2-1558m", 32 * 1024, 1600)):
        v = 50304
        h = torch.randn(n, c, device="cuda").to(torch.bfloat16)  # a LayerNorm's output
        w = (torch.randn(v, c, device="cuda") * 0.02 * 4).to(torch.bfloat16)
        y = torch.randint(0, 50257, (n,), device="cuda")
        # fp32 reference on a slice of rows (the whole would take 13 GB of logits)
        m = 8192
        hf, wf = h[:m].float(), w.float()
        logits = hf @ wf.t()
        ref_loss = torch.nn.functional.cross_entropy(logits, y[:m])
        p = torch.softmax(logits, 1)
        p[torch.arange(m), y[:m]] -= 1
        p /= m
        ref_gh, ref_gw = p @ wf, p.t() @ hf
        del logits, p
        for variant in ("bf16", "bwd8", "dh8", "all8"):
            loss, gh, gw = run(variant, h[:m].contiguous(), w, y[:m], None)
            err = {
                "loss_error": abs(loss.item() - ref_loss.item()),
                "grad_hidden_rel_error": ((gh.float() - ref_gh).norm() / ref_gh.norm()).item(),
                "grad_weight_rel_error": ((gw.float() - ref_gw).norm() / ref_gw.norm()).item(),
            }
            for _ in range(3):
                run(variant, h, w, y, None)
            t = Timer()
            reps = 10
            for _ in range(reps):
                run(variant, h, w, y, t)
                t.collect()
            parts = {k: round(val / reps, 3) for k, val in t.parts.items()}
            row = {
                "shape": name,
                "rows": n,
                "d": c,
                "vocab": v,
                "variant": variant,
                "ms": round(sum(parts.values()), 3),
                "parts_ms": parts,
                **err,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        del h, w
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
