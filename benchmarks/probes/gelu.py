"""How fast the GELU passes of gpt2-350m's MLP run against a plain copy, on (65536, 4096) bf16
(docs/decisions/048). On a GPU: ``python benchmarks/probes/gelu.py``; writes $OUT/gelu.json."""

import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)  # (B*T, 4C) of one micro-batch
grad = torch.randn_like(x)
NBYTES = x.numel() * x.element_size()


def timed(fn: Callable[[], object], n: int = 20) -> float:
    """Milliseconds per call, by CUDA events over ``n`` calls after 3."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def gelu_forms(approx: str) -> dict[str, tuple[Callable[[], object], int]]:
    """Each compiled pass and the tensors of x's size it reads and writes."""
    fwd = torch.compile(lambda t: F.gelu(t, approximate=approx))
    bwd = torch.compile(lambda g, t: torch.ops.aten.gelu_backward(g, t, approximate=approx))
    both = torch.compile(
        lambda g, t: (
            F.gelu(t, approximate=approx),
            torch.ops.aten.gelu_backward(g, t, approximate=approx),
        )
    )
    return {
        "forward (read 1, write 1)": (lambda: fwd(x), 2),
        "backward (read 2, write 1)": (lambda: bwd(grad, x), 3),
        "backward + forward again (read 2, write 2)": (lambda: both(grad, x), 4),
    }


out = torch.empty_like(x)
rows = {"copy (read 1, write 1)": (lambda: out.copy_(x), 2)}
for name, approx in (("exact", "none"), ("tanh", "tanh")):
    rows |= {f"gelu {name} {k}": v for k, v in gelu_forms(approx).items()}
results = {}
for label, (fn, passes) in rows.items():
    ms = timed(fn)
    results[label] = {"ms": round(ms, 4), "tb_per_s": round(passes * NBYTES / ms / 1e9, 3)}
    print(f"{label:55s} {ms:8.3f} ms {passes * NBYTES / ms / 1e9:6.2f} TB/s")
record = {"shape": list(x.shape), "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
          "torch": torch.__version__, "rows": results}  # fmt: skip
with open(os.path.join(os.environ.get("OUT", "."), "gelu.json"), "w") as f:
    json.dump(record, f, indent=1)
