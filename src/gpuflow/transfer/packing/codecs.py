"""Which dtype a tensor crosses the bus in: integers narrowed to the smallest type that holds
their values, floats sent as bf16 or fp16 when asked (``lossy_float``), anything else as it is.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError

LOSSY_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One codec for every float tensor, or one per top-level key of a mapping batch.
LossyFloat = str | Mapping[str, str | None] | None
_FLOAT_SOURCES = (torch.float32, torch.float64)
_NARROWABLE = (torch.int64, torch.int32)
_UINT16_MAX = 65535
_OR_MAX_NUMEL = 1 << 20  # beyond this torch's threaded aminmax beats one thread's OR


def codec_reads_values(dtype: torch.dtype, narrow: bool, lossy: torch.dtype | None) -> bool:
    """Whether a codec must see every value of a tensor of ``dtype`` to choose its wire
    dtype (or to refuse it)."""
    return (narrow and dtype in _NARROWABLE) or (lossy is not None and dtype in _FLOAT_SOURCES)


def wire_dtype(tensor: torch.Tensor, narrow: bool, lossy: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` crosses in: with ``narrow``, int64 and int32 values that fit as
    uint16 (or int64 ones as int32); with ``lossy``, float32 and float64 as ``lossy``, once
    its values are known to fit; otherwise its own."""
    dtype = tensor.dtype
    if narrow and dtype in _NARROWABLE and tensor.numel():
        known = _narrowed_by_or(tensor)
        if known is not None:
            return known
        low, high = (int(v) for v in torch.aminmax(tensor))
        if low >= 0 and high <= _UINT16_MAX:
            return torch.uint16
        if dtype == torch.int64 and low >= -(2**31) and high < 2**31:
            return torch.int32
    if lossy is not None and dtype in _FLOAT_SOURCES:
        if tensor.numel():
            _check_range(tensor, lossy)
        return lossy
    return dtype


def _check_range(tensor: torch.Tensor, codec: torch.dtype) -> None:
    """Refuse a finite value that would cross as inf in ``codec`` (an inf or NaN already there
    crosses as itself). One pass in the common case; past the codec's largest value, the
    conversion itself says which values round to inf (those within half a step of it round
    down to it)."""
    limit = torch.finfo(codec).max
    low, high = (float(v) for v in torch.aminmax(tensor))
    if -limit <= low and high <= limit:
        return
    overflows = torch.isinf(tensor.to(codec)) & torch.isfinite(tensor)
    if overflows.any():
        worst = tensor[overflows]
        value = float(worst[worst.abs().argmax()])
        name = "fp16" if codec == torch.float16 else "bf16"
        other = "use lossy_float='bf16'" if name == "fp16" else "send it as it is (no lossy_float)"
        raise GpuflowError(
            f"a float tensor holds {value:.6g}, beyond {name}'s range (±{limit:.6g}); it would "
            f"cross as inf: {other}"
        )


def _narrowed_by_or(tensor: torch.Tensor) -> torch.dtype | None:
    """The narrow dtype of the integer ``tensor`` when one bitwise OR over all its values
    settles it: none negative (a negative one sets the sign bit) and all within uint16, or
    all within int32; None when it does not (a negative value, a large or
    strided tensor), for ``aminmax`` to decide. One pass over the values, cheaper on the
    host than ``aminmax`` for a batch of token ids (docs/decisions/037)."""
    if not tensor.is_contiguous() or tensor.numel() > _OR_MAX_NUMEL:
        return None
    whole = int(np.bitwise_or.reduce(tensor.detach().numpy().reshape(-1)))
    if 0 <= whole <= _UINT16_MAX:
        return torch.uint16
    if 0 <= whole < 2**31:
        return torch.int32  # (an int32 tensor's own dtype: it crosses as it is)
    return None
