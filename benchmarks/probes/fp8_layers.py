"""Probe: a compiled GPT's forward+backward per micro-batch with bf16 and FP8 block products,
at the widths of gpt2-350m, -774m and -1558m; per-layer time from 2- and 6-layer models."""

import json
import os
import sys
import time

import torch

from gpuflow.model.fp8 import use_fp8_products
from gpuflow.model.gpt import GPT, ModelConfig

SHAPES = {
    "gpt2-350m": (16, 1024, 24, 64),
    "gpt2-774m": (20, 1280, 36, 48),
    "gpt2-1558m": (25, 1600, 48, 32),
}


def timed(n_layer, n_head, d, batch, fp8, T=1024, iters=8):
    torch.manual_seed(0)
    model = GPT(ModelConfig(50304, n_layer, n_head, d, T)).cuda().to(torch.bfloat16)
    if fp8:
        use_fp8_products(model)
    f = torch.compile(model)
    x = torch.randint(0, 50304, (batch, T), device="cuda")
    y = torch.randint(0, 50304, (batch, T), device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            loss = f(x, y)
        loss.backward()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with torch.autocast("cuda", torch.bfloat16):
            loss = f(x, y)
        loss.backward()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    out = times[len(times) // 2], loss.item(), grads
    del model, f
    torch.cuda.empty_cache()
    return out


results = {}
for name in sys.argv[1:] or SHAPES:
    n_head, d, L, batch = SHAPES[name]
    row = {"micro_batch": batch, "n_layer": L}
    grads = {}
    for fp8 in (False, True):
        t0 = time.time()
        t2, loss2, g = timed(2, n_head, d, batch, fp8)
        t6, _, _ = timed(6, n_head, d, batch, fp8)
        per_layer = (t6 - t2) / 4
        key = "fp8" if fp8 else "bf16"
        grads[key] = g
        row[key] = {
            "ms_2_layers": t2,
            "ms_6_layers": t6,
            "ms_per_layer": per_layer,
            "ms_est_full": t2 + (L - 2) * per_layer,
            "loss_2_layers": loss2,
            "wall_s": time.time() - t0,
        }
    row["grad_rel_err"] = ((grads["fp8"] - grads["bf16"]).norm() / grads["bf16"].norm()).item()
    row["speedup_full"] = row["bf16"]["ms_est_full"] / row["fp8"]["ms_est_full"]
    row["speedup_layer"] = row["bf16"]["ms_per_layer"] / row["fp8"]["ms_per_layer"]
    results[name] = row
    print(name, json.dumps(row), flush=True)
with open(os.environ.get("OUT", ".") + "/fp8_layers.json", "w") as f:
    json.dump(results, f, indent=1)
