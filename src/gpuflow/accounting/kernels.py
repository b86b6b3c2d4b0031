"""Where a step's device time goes: its kernels grouped by what they compute.

    groups = kernel_breakdown(trace.activity, steps=10, flops=step_flops(config, tokens))
    for g in groups.rows: print(g.group, g.us_per_step, g.share, g.tflop_per_s)

A kernel's group comes from its name: cuBLAS and CUTLASS products are ``matmul``; attention
kernels (FlexAttention's templates, flash and cuDNN attention) are ``attention``; the fused
output head and loss (``gpuflow.model.head``) is ``loss``; the AdamW and clip kernels are
``optimizer``; Inductor's fused kernels are ``norm`` when they hold a layer norm and
``elementwise`` otherwise; NCCL's are ``collective``; anything else is ``other``. ``idle`` is the
time within the steps when no kernel ran. The arithmetic rate of a group is given where its
FLOPs are known from the model's shape (``matmul``, ``attention``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from gpuflow.accounting.crosscheck import Interval

# (group, pattern on the lower-cased kernel name), first match wins
_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (group, re.compile(pattern))
    for group, pattern in (
        ("collective", r"nccl|peer_average"),
        ("loss", r"softmax_grad_rows|cross_entropy|nll_loss|log_softmax"),
        ("optimizer", r"adamw|adam_|multi_tensor|foreach|clip|norm_kernel"),
        ("attention", r"flex_attention|flash|fmha|attention|sdpa|mha|triton_tem_fused"),
        ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|wgmma|triton_tem_fused_mm|addmm|bmm"),
        ("norm", r"layer_norm|native_layer_norm|rms_norm|layernorm"),
        ("memory", r"memcpy|memset|copy_kernel"),
        ("elementwise", r"^triton_|elementwise|vectorized|reduce|unrolled|index|gather|scatter"),
    )
)
GROUP_ORDER = (
    "matmul", "attention", "norm", "elementwise", "loss", "optimizer", "collective", "memory",
    "other", "idle",
)  # fmt: skip


def group_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    for group, pattern in _GROUPS:
        if pattern.search(name):
            return group
    return "other"


@dataclass(frozen=True)
class GroupRow:
    group: str
    us_per_step: float
    share: float  # of the step's device span
    kernels_per_step: float
    tflop_per_s: float | None  # where the group's FLOPs are known


@dataclass(frozen=True)
class Breakdown:
    step_us: float
    rows: list[GroupRow]
    top: list[tuple[str, str, float]]  # (group, kernel name, µs per step), the longest first

    def as_dict(self) -> dict:
        return {
            "step_us": self.step_us,
            "groups": [row.__dict__ for row in self.rows],
            "top_kernels": [{"group": g, "name": n, "us_per_step": us} for g, n, us in self.top],
        }


def _busy_us(intervals: list[Interval]) -> float:
    """The time covered by at least one of ``intervals``."""
    busy, end = 0.0, float("-inf")
    for a in sorted(intervals, key=lambda a: a.start):
        if a.end > end:
            busy += a.end - max(a.start, end)
            end = a.end
    return busy


def kernel_breakdown(
    activity: list[Interval], steps: int, flops: dict[str, float] | None = None, top: int = 15
) -> Breakdown:
    """Per-step device time of each group over ``steps`` steps of ``activity``; ``flops``
    maps a group to its FLOPs per step (for its rate)."""
    kernels = [a for a in activity if a.kind == "kernel"]
    if not kernels or steps < 1:
        return Breakdown(0.0, [], [])
    span = max(a.end for a in kernels) - min(a.start for a in kernels)
    by_group: dict[str, list[Interval]] = defaultdict(list)
    by_name: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_group[group_of(k.name)].append(k)
        by_name[k.name] += k.end - k.start
    rows = []
    for group in GROUP_ORDER:
        if group == "idle":
            us = (span - _busy_us(kernels)) / steps
            count = 0.0
        elif group in by_group:
            us = sum(k.end - k.start for k in by_group[group]) / steps
            count = len(by_group[group]) / steps
        else:
            continue
        work = (flops or {}).get(group)
        rate = work / (us * 1e-6) / 1e12 if work and us > 0 else None
        rows.append(GroupRow(group, us, us * steps / span, count, rate))
    longest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return Breakdown(span / steps, rows, [(group_of(n), n, us / steps) for n, us in longest])


def step_flops(d_model: int, n_layer: int, seq_len: int, vocab: int, tokens: int) -> dict:
    """FLOPs per training step (forward and backward) of the matrix products and of
    attention, for ``tokens`` tokens a step: 6 per weight per token for the products
    (the four of each block and the tied head), 12·L·d·T per token for attention (as in
    ``flops_per_token``; the causal half that a masked kernel skips is counted)."""
    d = d_model
    return {
        "matmul": 6.0 * tokens * (n_layer * 12 * d * d + vocab * d),
        "attention": 12.0 * tokens * n_layer * d * seq_len,
    }
