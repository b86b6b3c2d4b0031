"""The output head and cross-entropy as one operation that returns its gradients early.

``F.cross_entropy(F.linear(h, W).float(), y)`` writes the (N, V) logits, reads them into an
fp32 log-softmax, keeps what the backward needs and reads it all again there: with a vocab of
16000-50304 that is the largest memory traffic of a small model's step (4096 x 16000 fp32
logits are 262 MB). The loss is the last thing a step computes, so its gradient with respect
to the logits is known as soon as the logits are: ``softmax - one_hot``, divided by N. This
operation computes it in the forward, over the logits buffer itself, in one pass per row:
- on CUDA a Triton kernel overwrites each row of logits with the row's gradient, in the
  logits' own dtype: a row of up to 16384 is read once and held in registers, a longer
  one is read for its log-sum-exp and again (mostly from L2) for the gradient;
- elsewhere the same arithmetic runs as tensor operations (fp32 temporaries).
The two matrix products of the backward then run on that buffer, inside the forward, and
the backward only scales the stored gradients by the incoming one (1.0 for a loss).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


if triton is not None:

    @triton.jit
    def softmax_grad_rows(
        logits_ptr,  # (N, V), overwritten with d(mean loss)/d(logits)
        targets_ptr,  # (N,) int64
        losses_ptr,  # (N,) fp32, each row's cross-entropy
        stride,
        vocab,
        rows,
        BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,  # BLOCK >= vocab: the row is read once, kept in registers
    ):
        row = tl.program_id(0).to(tl.int64)
        inv_rows = 1.0 / rows
        base = logits_ptr + row * stride
        target = tl.load(targets_ptr + row)
        target_logit = tl.load(base + target).to(tl.float32)
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
            row_max = tl.max(x, 0)
            exps = tl.exp(x - row_max)
            total = tl.sum(exps, 0)
            lse = row_max + tl.log(total)
            grad = exps / total - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, (grad * inv_rows).to(logits_ptr.dtype.element_ty), mask=mask)
        else:
            # Pass 1: an online max and sum of exponentials over the row.
            running_max = tl.full([], float("-inf"), tl.float32)
            running_sum = tl.full([], 0.0, tl.float32)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                new_max = tl.maximum(running_max, tl.max(x, 0))
                running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
                    tl.exp(x - new_max), 0
                )
                running_max = new_max
            lse = running_max + tl.log(running_sum)
            # Pass 2: the row again (an L2 hit), replaced by (softmax - one_hot) / N.
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vocab
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
                tl.store(base + cols, (grad * inv_rows).to(logits_ptr.dtype.element_ty), mask=mask)
        tl.store(losses_ptr + row, lse - target_logit)


# Rows up to this long are held in registers whole; longer ones are read twice.
ONE_PASS_MAX = 16384


def kernel_config(vocab: int) -> dict[str, int | bool]:
    """Block size, one or two passes and warps of the softmax-gradient kernel for ``vocab``."""
    whole = 1 << (vocab - 1).bit_length()
    if whole <= ONE_PASS_MAX:
        return {"BLOCK": whole, "ONE_PASS": True, "num_warps": 16 if whole > 4096 else 8}
    return {"BLOCK": 8192, "ONE_PASS": False, "num_warps": 16}


def _softmax_grad_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy (N,) fp32 of ``logits`` (N, V), which become the mean loss's
    gradient in place."""
    rows, vocab = logits.shape
    if triton is not None and logits.is_cuda:
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        softmax_grad_rows[(rows,)](
            logits, targets, losses, logits.stride(0), vocab, rows, **kernel_config(vocab)
        )
        return losses
    wide = logits.float()  # (N, V)
    lse = torch.logsumexp(wide, dim=1)  # (N,)
    losses = lse - wide.gather(1, targets[:, None]).squeeze(1)
    grad = torch.exp(wide - lse[:, None])  # (N, V) softmax
    grad.scatter_add_(1, targets[:, None], grad.new_full((rows, 1), -1.0))
    logits.copy_(grad.div_(rows))
    return losses


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype):
        h = hidden.to(dtype)  # (N, C)
        w = weight.to(dtype)  # (V, C)
        logits = h @ w.t()  # (N, V); becomes its own gradient below
        loss = _softmax_grad_(logits, targets).mean()
        grad_hidden = (logits @ w).to(hidden.dtype)  # (N, C)
        grad_weight = (logits.t() @ h).to(weight.dtype)  # (V, C)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy (fp32 scalar) of ``hidden`` (N, C) @ ``weight`` (V, C).T against
    ``targets`` (N,), as ``F.cross_entropy(F.linear(hidden, weight).float(), targets)``.

    The matrix products run in autocast's dtype when autocast is on (as ``F.linear`` would);
    with gradients off it is the plain computation, since nothing would use them.
    """
    device_type = hidden.device.type
    dtype = (
        torch.get_autocast_dtype(device_type)
        if torch.is_autocast_enabled(device_type)
        else hidden.dtype
    )
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        logits = hidden.to(dtype) @ weight.to(dtype).t()  # (N, V)
        return torch.nn.functional.cross_entropy(logits.float(), targets)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, dtype)
