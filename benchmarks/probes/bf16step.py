"""Probe: forward + backward of seed-d384, fp32 weights under bf16 autocast vs bf16 weights.

What keeping the model's own weights in bf16 (fp32 masters in the optimizer) would save in
casts and in residual-stream traffic, the optimizer left out. Each variant is compiled with
the trainer's options and captured in a CUDA graph on one fixed batch.

PYTHONPATH=src python3 benchmarks/probes/bf16step.py [preset] [out.json]
"""

import json
import sys

import torch

from gpuflow.model.gpt import GPT
from gpuflow.train.config import preset as preset_config
from gpuflow.train.step import COMPILE_OPTIONS

name = sys.argv[1] if len(sys.argv) > 1 else "seed-d384"
config = preset_config(name)
B, T, V = config.train.batch_size, config.model.max_len, config.model.vocab_size
tokens = torch.randint(0, V, (B, T + 1), device="cuda")
results = []
for label in ("fp32+autocast", "bf16"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(config.model).cuda()
    if label == "bf16":
        model = model.to(torch.bfloat16)
    forward = torch.compile(model, options=dict(COMPILE_OPTIONS))

    def step(forward=forward, model=model, label=label):
        with torch.autocast("cuda", torch.bfloat16, enabled=label != "bf16", cache_enabled=False):
            loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 100
    row = {"preset": name, "variant": label, "fwd_bwd_ms": ms, "loss": loss.item()}
    print(row, flush=True)
    results.append(row)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as out:
        out.write(json.dumps(results, indent=1))
