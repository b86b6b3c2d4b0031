"""Probe: the head's softmax-gradient kernel alone, by block size, passes and warps.

Effective bandwidth counts one read and one write of the (N, V) bf16 logits.

PYTHONPATH=src python3 benchmarks/probes/softmaxgrad.py [out.json]
"""

import json
import sys

import torch

from gpuflow.model.head import kernel_config, softmax_grad_rows

rows = []
for n, v in ((4096, 16000), (32768, 50304)):
    logits = torch.randn(n, v, device="cuda").to(torch.bfloat16)
    work = logits.clone()
    targets = torch.randint(0, v, (n,), device="cuda")
    losses = torch.empty(n, device="cuda")
    whole = 1 << (v - 1).bit_length()
    configs = [(b, False, w) for b in (2048, 4096, 8192) for w in (4, 8, 16)]
    configs += [(whole, True, w) for w in (8, 16, 32)]
    for block, one_pass, warps in configs:

        def launch(block=block, one_pass=one_pass, warps=warps, n=n, v=v):
            work.copy_(logits)  # noqa: B023 - used within the iteration that defines it
            softmax_grad_rows[(n,)](
                work,  # noqa: B023
                targets,  # noqa: B023
                losses,  # noqa: B023
                v,
                v,
                n,
                BLOCK=block,
                ONE_PASS=one_pass,
                num_warps=warps,
            )

        try:
            launch()
        except Exception as error:  # a block too large for the registers, say
            print(n, v, block, one_pass, warps, "failed:", str(error)[:80])
            continue
        copy_only = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        both = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copy_only[0].record()
        for _ in range(20):
            work.copy_(logits)
        copy_only[1].record()
        both[0].record()
        for _ in range(20):
            launch()
        both[1].record()
        torch.cuda.synchronize()
        us = (both[0].elapsed_time(both[1]) - copy_only[0].elapsed_time(copy_only[1])) / 20 * 1e3
        gbs = 2 * n * v * 2 / us / 1e3
        ref = torch.softmax(logits.float(), 1)
        ref[torch.arange(n), targets] -= 1
        err = ((work.float() * n) - ref).abs().max().item()
        row = dict(n=n, v=v, block=block, one_pass=one_pass, warps=warps, us=us, gbs=gbs, err=err)
        row["chosen"] = kernel_config(v) == {
            "BLOCK": block,
            "ONE_PASS": one_pass,
            "num_warps": warps,
        }
        print(row, flush=True)
        rows.append(row)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as out:
        out.write(json.dumps(rows, indent=1))
