"""The fused output head + cross-entropy against the two-step reference it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuflow.model.head import kernel_config, linear_cross_entropy


def _pair(n: int = 48, c: int = 16, v: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g)
    weight = torch.randn(v, c, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _grads(fn, hidden, weight, targets, scale=1.0):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(h, w, targets)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _reference(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def test_loss_and_gradients_match_the_reference():
    hidden, weight, targets = _pair()
    # A scaled loss: the stored gradients are multiplied by the incoming one.
    got = _grads(linear_cross_entropy, hidden, weight, targets, scale=3.0)
    want = _grads(_reference, hidden, weight, targets, scale=3.0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_weight_used_twice_sums_both_gradients():
    # The head is tied to the token table: the table's gradient is the lookup's plus the head's.
    hidden, weight, targets = _pair(n=8, v=50)
    ids = torch.tensor([3, 7, 7, 49])

    def tied(fn):
        w = weight.clone().requires_grad_()
        fn(w[ids].sum(0, keepdim=True) + hidden, w, targets).backward()
        return w.grad

    torch.testing.assert_close(tied(linear_cross_entropy), tied(_reference))


def test_without_gradients_it_is_the_plain_loss():
    hidden, weight, targets = _pair()
    w = weight.clone().requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, w, targets)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _reference(hidden, weight, targets))


def test_under_autocast_the_products_run_in_its_dtype():
    hidden, weight, targets = _pair(n=64, c=32, v=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, h_grad, w_grad = _grads(linear_cross_entropy, hidden, weight, targets)
        ref_loss, ref_h, ref_w = _grads(_reference, hidden, weight, targets)
    assert loss.dtype == torch.float32
    assert (h_grad.dtype, w_grad.dtype) == (torch.float32, torch.float32)  # the inputs' dtypes
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h_grad, ref_h, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(w_grad, ref_w, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize(
    ("vocab", "one_pass"), [(100, True), (16000, True), (16384, True), (16385, False)]
)
def test_rows_up_to_16384_are_read_once(vocab, one_pass):
    config = kernel_config(vocab)
    assert config["ONE_PASS"] == one_pass
    assert config["BLOCK"] >= vocab if one_pass else config["BLOCK"] < vocab
