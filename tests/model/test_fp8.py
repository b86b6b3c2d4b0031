"""FP8 products of the blocks' linear layers, on the cpu's _scaled_mm: the numbers against
the exact product, where they are used and where not, and the refusal off FP8 hardware."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuflow.common.errors import GpuflowError
from gpuflow.model.fp8 import (
    E4M3,
    E5M2,
    FP8Linear,
    check_fp8,
    fp8_linear,
    quantise,
    use_fp8_products,
)
from gpuflow.model.gpt import GPT, ModelConfig


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Activations with a few outliers, as LayerNorm outputs have; GPT-2-sized weights.
    x = torch.randn(256, 192, generator=g) * (1 + 9 * (torch.rand(256, 1, generator=g) > 0.97))
    w = torch.randn(96, 192, generator=g) * 0.02
    grad = torch.randn(256, 96, generator=g) * 1e-4
    return x.bfloat16(), w.bfloat16(), grad.bfloat16()


def test_products_and_both_gradients_match_the_exact_ones_to_fp8s_precision():
    x, w, grad = _operands()
    got, want = [], []
    for fn, out in ((fp8_linear, got), (F.linear, want)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(grad)
        out.extend([y, xi.grad, wi.grad])
    assert [t.dtype for t in got] == [torch.bfloat16] * 3
    assert [t.shape for t in got] == [t.shape for t in want]
    # e4m3 keeps 3 mantissa bits (a relative step of 1/16), e5m2 2 (1/8): a product of K
    # such terms errs by a few percent, the gradients (e5m2 on one side) by about twice that.
    assert _rel(got[0], want[0]) < 0.06
    assert _rel(got[1], want[1]) < 0.10
    assert _rel(got[2], want[2]) < 0.10
    # Not the exact product: FP8 was used.
    assert _rel(got[0], want[0]) > 1e-3


def test_a_tensor_is_scaled_onto_the_formats_range_and_back():
    x = torch.tensor([[0.001, -0.5, 2.0, 1e-6]])
    for dtype in (E4M3, E5M2):
        q, inverse = quantise(x, dtype)
        assert q.dtype == dtype
        assert q.float().abs().max().item() == torch.finfo(dtype).max  # 2.0 lands on the max
        assert (q.float() * inverse).tolist()[0][:3] == pytest.approx([0.001, -0.5, 2.0], rel=0.13)


def test_a_zero_gradient_gives_zero_gradients_not_nans():
    x, w, _ = _operands()
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(xi, wi).backward(torch.zeros(256, 96, dtype=torch.bfloat16))
    assert torch.equal(xi.grad, torch.zeros_like(x)) and torch.equal(wi.grad, torch.zeros_like(w))


def test_batched_inputs_and_fp32_weights_under_autocast():
    x, w, _ = _operands()
    x3 = x.float().view(4, 64, 192).requires_grad_()
    w32 = w.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x3, w32)
    assert y.shape == (4, 64, 96) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x3.grad.dtype == torch.float32 and w32.grad.dtype == torch.float32
    assert _rel(y.view(256, 96), F.linear(x, w)) < 0.06


def test_the_blocks_products_switch_and_nothing_else_changes():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, max_len=16)
    model = GPT(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_fp8_products(model) == 4 * config.n_layer  # qkv, attention out, MLP in and out
    assert all(
        type(m) is FP8Linear
        for b in model.blocks
        for m in b.modules()
        if isinstance(m, torch.nn.Linear)
    )
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The state dict loads into a model that never used FP8.
    GPT(config).load_state_dict(after)

    ids = torch.randint(128, (2, 16))
    plain = GPT(config)
    plain.load_state_dict(after)
    with torch.no_grad():  # inference keeps the exact products
        assert torch.equal(model(ids, ids), plain(ids, ids))
    loss = model(ids, ids)  # training takes the FP8 ones: close, not equal
    assert loss.item() == pytest.approx(plain(ids, ids).item(), rel=1e-2)
    assert loss.item() != plain(ids, ids).item()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores():
    with pytest.raises(GpuflowError, match=r"train\.fp8=false"):
        check_fp8(torch.device("cpu"), 64, 64)


@pytest.mark.gpu
def test_fp8_is_refused_for_sides_the_fp8_kernels_cannot_take():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no CUDA GPU with FP8 tensor cores")
    check_fp8(torch.device("cuda"), 64, 128)
    with pytest.raises(GpuflowError, match=r"model\.d_model to be a multiple of 16"):
        check_fp8(torch.device("cuda"), 72, 128)
    with pytest.raises(GpuflowError, match=r"model\.max_len to be a multiple of 16"):
        check_fp8(torch.device("cuda"), 64, 100)


def _columns_taken(device: str) -> None:
    x, w, grad = (t.to(device) for t in _operands())
    xi = x.t().contiguous().t().requires_grad_()  # (256, 192) stored by columns
    wi = w.clone().requires_grad_()
    y = fp8_linear(xi, wi)
    y.backward(grad.t().contiguous().t())  # the gradient by columns too
    assert _rel(y, F.linear(x, w)) < 0.06
    assert xi.grad.shape == x.shape and torch.isfinite(wi.grad).all()


def test_operands_and_gradients_laid_out_by_columns_are_taken():
    _columns_taken("cpu")


@pytest.mark.gpu
def test_operands_and_gradients_laid_out_by_columns_are_taken_on_fp8_tensor_cores():
    # CUDA's FP8 products take only their first operand by rows: the others are laid out
    # before they reach it.
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no CUDA GPU with FP8 tensor cores")
    _columns_taken("cuda")
