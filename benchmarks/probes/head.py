"""Probe: the output head + cross-entropy, forward and backward, three ways.

stock: F.cross_entropy(F.linear(h, W).float(), y) under bf16 autocast, compiled;
fused: gpuflow.model.head.linear_cross_entropy (Triton softmax-gradient kernel), compiled;
fused-ops: the same with its tensor-operation fallback instead of the kernel, compiled.
Shapes: seed-d384 (N 4096, C 384, V 16000) and gpt2-124m at B 16 (N 16384, C 768, V 50304).

PYTHONPATH=src python3 benchmarks/probes/head.py [out.json]
"""

import json
import sys

import torch
import torch.nn.functional as F

import gpuflow.model.head as head


def stock(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def fused_ops(h, w, y):
    saved, head.triton = head.triton, None
    try:
        return head.linear_cross_entropy(h, w, y)
    finally:
        head.triton = saved


def timed(fn, h, w, y, reps=20):
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        loss.backward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        loss.backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, loss.item()


results = []
for name, (n, c, v) in {"seed-d384": (4096, 384, 16000), "gpt2-124m": (16384, 768, 50304)}.items():
    torch.manual_seed(0)
    h = (torch.randn(n, c, device="cuda")).requires_grad_()
    w = (torch.randn(v, c, device="cuda") * 0.02).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    grads = {}
    variants = {"stock": stock, "fused": head.linear_cross_entropy, "fused-ops": fused_ops}
    for label, fn in variants.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        h.grad = w.grad = None
        ms, loss = timed(compiled, h, w, y)
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(h, w, y).backward()
        grads[label] = (h.grad.clone(), w.grad.clone())
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(h, w, y).backward()
        peak = torch.cuda.max_memory_allocated() / 1e6
        row = {"shape": name, "variant": label, "ms": ms, "loss": loss, "peak_mb": peak}
        if label != "stock":
            row["max_grad_diff"] = [
                (a - b).abs().max().item() / b.abs().max().item()
                for a, b in zip(grads[label], grads["stock"], strict=True)
            ]
        print(row, flush=True)
        results.append(row)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as out:
        out.write(json.dumps(results, indent=1))
