"""FP8 matrix products for the blocks' linear layers.

Each product quantises its two operands to FP8 with one scale per tensor, found on the
device from the tensor's largest magnitude (no host sync, so it captures in a CUDA graph),
and multiplies them on the FP8 tensor cores (``torch._scaled_mm``), accumulating in fp32 and
writing bf16. The forward's operands (activations and weights) are e4m3, three mantissa bits
over a range of ±448; the gradient flowing back is e5m2, two bits over ±57,344, since
gradients span more orders of magnitude than they need precision. The backward keeps the
forward's FP8 operands instead of their bf16 originals, half the bytes.

The weights stay what they were (bf16 over fp32 masters, or fp32): only each product's
operands are narrowed, so checkpoints, sampling and export do not know FP8 was used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuflow.common.errors import GpuflowError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Smallest amax a scale is taken from: an all-zero tensor (a gradient that vanished) then
# quantises to zeros instead of dividing by zero.
MIN_AMAX = 1e-12
# Hopper (sm_90) and Ada (sm_89) have FP8 tensor cores; torch's _scaled_mm refuses others.
MIN_CAPABILITY = (8, 9)
# Tensor cores' fast accumulation (no periodic promotion to fp32) in the forward's product
# only: in the backward's two it would be faster still, kept off for the gradients' sake
# (docs/decisions/050).
FORWARD_FAST_ACCUM, BACKWARD_FAST_ACCUM = True, False


def quantise(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as FP8 ``dtype`` (same shape) scaled so its largest magnitude lands on the
    format's largest, and the fp32 scalar that multiplies it back (what _scaled_mm takes)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=MIN_AMAX)  # () fp32
    scale = fmax / amax
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same (R, C) matrix laid out column by column: _scaled_mm's second operand."""
    return t.t().contiguous().t()


class _FP8Product(torch.autograd.Function):
    """x (M, K) @ w (N, K).T -> (M, N), both directions in FP8."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        xq, x_inv = quantise(x, E4M3)  # (M, K)
        wq, w_inv = quantise(w, E4M3)  # (N, K)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.w_dtype = w.dtype
        return torch._scaled_mm(
            xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype,
            use_fast_accum=FORWARD_FAST_ACCUM,
        )  # fmt: skip

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = quantise(grad.contiguous(), E5M2)  # (M, N), by rows as _scaled_mm takes it
        # (M, N) @ (N, K): the weight's FP8 copy laid out by columns.
        grad_x = torch._scaled_mm(
            gq, column_major(wq), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype,
            use_fast_accum=BACKWARD_FAST_ACCUM,
        )  # fmt: skip
        # (N, M) @ (M, K): the gradient by rows of its transpose, the input by columns.
        grad_w = torch._scaled_mm(
            gq.t().contiguous(), column_major(xq), scale_a=g_inv, scale_b=x_inv,
            out_dtype=grad.dtype, use_fast_accum=BACKWARD_FAST_ACCUM,
        )  # fmt: skip
        return grad_x, grad_w.to(ctx.w_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) with FP8 products; x (..., K), weight (N, K).
    Under autocast both operands enter in autocast's dtype, as F.linear's would."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        y = _FP8Product.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight)  # (M, N)
    return y.view(*x.shape[:-1], weight.shape[0])


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` without bias whose product runs in FP8 (``fp8_linear``) while
    gradients are on; inference (validation, sampling) keeps the exact product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight)


def check_fp8(device: torch.device, d_model: int, max_len: int) -> None:
    """Refuse FP8 products where this device has no FP8 tensor cores, or where a product's
    sides are not multiples of 16 (the FP8 kernels' requirement: d_model for the forward,
    a micro-batch's tokens, whole windows of max_len, for the weight gradient)."""
    if device.type != "cuda":
        raise GpuflowError(
            f"train.fp8 needs a CUDA GPU with FP8 tensor cores (Ada or Hopper); this run is on "
            f"{device.type}: set train.fp8=false"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise GpuflowError(
            f"train.fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: set "
            "train.fp8=false"
        )
    for name, value in (("d_model", d_model), ("max_len", max_len)):
        if value % 16:
            raise GpuflowError(
                f"train.fp8 needs model.{name} to be a multiple of 16 (FP8 products take "
                f"sides of 16), got {value}: change it or set train.fp8=false"
            )


def use_fp8_products(model: nn.Module) -> int:
    """Switch every bias-free ``nn.Linear`` of ``model``'s blocks to FP8 products, in place
    (parameters and state dict unchanged); returns how many. The output head, tied to the
    token table, keeps its bf16 product: its fused cross-entropy is its own kernel."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            module.__class__ = FP8Linear
            count += 1
    return count
