"""Probe: where a compiled 6-layer GPT's forward+backward time goes, bf16 against FP8 block
products (FAST_ACCUM variants), by kernel."""

import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from gpuflow.model import fp8
from gpuflow.model.gpt import GPT, ModelConfig

torch._dynamo.config.recompile_limit = 64
n_head, d, batch = {"350": (16, 1024, 64), "1558": (25, 1600, 32)}[sys.argv[1]]


def run(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(ModelConfig(50304, 6, n_head, d, 1024)).cuda().to(torch.bfloat16)
    if mode != "bf16":
        fp8.FAST_ACCUM.update(forward=mode[1] == "1", backward=mode[2] == "1")
        fp8.use_fp8_products(model)
    f = torch.compile(model)
    x = torch.randint(0, 50304, (batch, 1024), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = f(x, x)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] += e.device_time / 3 / 1000
    total = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
    print(mode, f"total {total:.2f} ms")
    for k, v in top:
        print(f"  {v:8.3f}  {k}")
    return {"total_ms": total, "top": top}


out = {m: run(m) for m in ("bf16", "f10", "f11")}
with open(os.environ.get("OUT", ".") + f"/fp8_profile_{sys.argv[1]}.json", "w") as fh:
    json.dump(out, fh, indent=1)
