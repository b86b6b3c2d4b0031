"""Probe: could FP8 matrix products pay at gpt2-124m's shapes? One linear layer's forward
and backward (y = x·wᵀ, dx = g·w, dw = gᵀ·x) in bf16 against FP8 with per-tensor scales
computed on the device each step (x and w in e4m3, the output gradient in e5m2), the
scaling, casts and transposes FP8 needs counted in; and the three FP8 products alone on
inputs cast beforehand (what FP8 could give if its casts were free). Each is timed as a CUDA
graph, so the host's launch time is out. Prints ms per layer and the model's total for each
shape, and writes JSON.

PYTHONPATH=src python3 benchmarks/probes/fp8linear.py [out.json] [tokens]
"""

import json
import sys

import torch
from triton.testing import do_bench_cudagraph

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 16384  # gpt2-124m's batch of 16 x 1024
D, V = 768, 50304
# (name, in K, out N, how many in the model)
SHAPES = [("qkv", D, 3 * D, 12), ("proj", D, D, 12), ("fc", D, 4 * D, 12),
          ("fc2", 4 * D, D, 12), ("head", D, V, 1)]  # fmt: skip


@torch.compile
def scaled_transposed(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``t`` and its transpose (contiguous) cast to ``dtype`` under one scale."""
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().float().clamp(min=1e-12)
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return q, q.t().contiguous(), scale.reciprocal()


def bf16_step(x, w, g):
    y = x @ w.t()  # (M, N)
    dx = g @ w  # (M, K)
    dw = g.t() @ x  # (N, K)
    return y, dx, dw


def fp8_step(x, w, g):
    x8, xt8, sx = scaled_transposed(x, E4M3)  # (M, K), (K, M)
    w8, wt8, sw = scaled_transposed(w, E4M3)  # (N, K), (K, N)
    g8, gt8, sg = scaled_transposed(g, E5M2)  # (M, N), (N, M)
    y = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16)  # (M, N)
    dx = torch._scaled_mm(g8, wt8.t(), sg, sw, out_dtype=torch.bfloat16)  # (M, K)
    dw = torch._scaled_mm(gt8, xt8.t(), sg, sx, out_dtype=torch.bfloat16)  # (N, K)
    return y, dx, dw


def fp8_products(x8, xt8, sx, w8, wt8, sw, g8, gt8, sg):
    y = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16)  # (M, N)
    dx = torch._scaled_mm(g8, wt8.t(), sg, sw, out_dtype=torch.bfloat16)  # (M, K)
    dw = torch._scaled_mm(gt8, xt8.t(), sg, sx, out_dtype=torch.bfloat16)  # (N, K)
    return y, dx, dw


def measure(name: str, k: int, n: int, count: int) -> dict:
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)  # (M, K)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02  # (N, K)
    g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16) * 1e-3  # (M, N)
    pairs = zip(fp8_step(x, w, g), bf16_step(x, w, g), strict=True)
    error = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in pairs]
    x8, xt8, sx = scaled_transposed(x, E4M3)
    w8, wt8, sw = scaled_transposed(w, E4M3)
    g8, gt8, sg = scaled_transposed(g, E5M2)
    ms = {
        "bf16": do_bench_cudagraph(lambda: bf16_step(x, w, g)),
        "fp8": do_bench_cudagraph(lambda: fp8_step(x, w, g)),
        "fp8_products_only": do_bench_cudagraph(
            lambda: fp8_products(x8, xt8, sx, w8, wt8, sw, g8, gt8, sg)
        ),
    }
    flops = 6 * TOKENS * k * n
    return {
        "shape": name, "M": TOKENS, "K": k, "N": n, "count": count, "ms": ms,
        "tflop_per_s": {p: flops / t / 1e9 for p, t in ms.items()},
        "relative_error_y_dx_dw": error,
    }  # fmt: skip


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    torch.manual_seed(0)
    rows, totals = [], {"bf16": 0.0, "fp8": 0.0, "fp8_products_only": 0.0}
    for name, k, n, count in SHAPES:
        row = measure(name, k, n, count)
        rows.append(row)
        ms, rate = row["ms"], row["tflop_per_s"]
        for path in totals:
            totals[path] += count * ms[path]
        print(
            f"{name:5s} {TOKENS}x{k}x{n}: bf16 {ms['bf16']:.3f} ms ({rate['bf16']:.0f} TFLOP/s), "
            f"fp8 {ms['fp8']:.3f} ms ({rate['fp8']:.0f}), products alone "
            f"{ms['fp8_products_only']:.3f} ms ({rate['fp8_products_only']:.0f}); relative error "
            f"{[round(e, 4) for e in row['relative_error_y_dx_dw']]}",
            flush=True,
        )
    print(
        f"all of the model's products, forward and backward: bf16 {totals['bf16']:.2f} ms, "
        f"fp8 {totals['fp8']:.2f} ms, fp8 products alone {totals['fp8_products_only']:.2f} ms"
    )
    if out:
        with open(out, "w") as f:
            json.dump({"tokens": TOKENS, "rows": rows, "total_ms": totals}, f, indent=1)


if __name__ == "__main__":
    main()
