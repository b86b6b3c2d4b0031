"""The model's device kernels: the fused head against fp32 cross-entropy, FlexAttention
against SDPA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [1000, 16000, 50304])  # one pass, one pass, two passes
def test_the_fused_head_kernel_matches_fp32_cross_entropy(accel, vocab):
    import torch.nn.functional as F

    from gpuflow.model.head import linear_cross_entropy

    g = torch.Generator(device=accel.torch).manual_seed(0)
    hidden = torch.randn(512, 64, device=accel.torch, generator=g)
    weight = torch.randn(vocab, 64, device=accel.torch, generator=g) * 0.3
    targets = torch.randint(0, vocab, (512,), device=accel.torch, generator=g)

    def run(fn, autocast):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(accel.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w, targets)
        (2 * loss).backward()
        return loss.detach(), h.grad, w.grad

    reference = run(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), autocast=False)
    torch._dynamo.reset()  # compiled for this vocab alone, as the trainer compiles per model
    for fn in (linear_cross_entropy, torch.compile(linear_cross_entropy)):
        got = run(fn, autocast=True)
        for a, b in zip(got, reference, strict=True):
            assert a.dtype == b.dtype == torch.float32
            # bf16 products against fp32 ones: about 3 significant digits
            assert (a - b).abs().max() <= 1e-2 * b.abs().max(), vocab


def test_compiled_attention_uses_flex_and_matches_sdpa(accel):
    from torch._dynamo.testing import CompileCounterWithBackend

    from gpuflow.model.gpt import CausalSelfAttention, ModelConfig

    if accel.type != "cuda":
        pytest.skip("FlexAttention is taken on CUDA only")
    config = ModelConfig(vocab_size=100, n_layer=1, n_head=6, d_model=384, max_len=128)
    torch.manual_seed(0)
    attention = CausalSelfAttention(config).to(accel.torch)
    x = torch.randn(4, 128, 384, device=accel.torch)

    def run(fn):
        attention.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with accel.autocast(cache=False):
            y = fn(xi)
        (y.float() ** 2).mean().backward()
        return y.float(), xi.grad, attention.qkv.weight.grad

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = run(torch.compile(attention, backend=counter))
    graph = "\n".join(str(g.graph) for g in counter.graphs)
    assert "flex_attention" in graph and "scaled_dot_product" not in graph
    eager = run(attention)
    for a, b in zip(compiled, eager, strict=True):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_recomputed_blocks_compile_train_alike_and_take_less_memory_a_sequence(accel):
    if accel.type != "cuda":
        pytest.skip("device memory is measured on cuda")
    from gpuflow.model.gpt import GPT, ModelConfig
    from gpuflow.train.batching import device_fit

    config = ModelConfig(vocab_size=4096, n_layer=4, n_head=8, d_model=512, max_len=512)
    ids = torch.randint(4096, (8, 513), device=accel.torch)
    grads, per_sequence = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(config).to(accel.torch)
        model.recompute_blocks = recompute
        fit = device_fit(model, accel, 512, 4096, reserved=0)
        per_sequence.append(fit.per_sequence)
        torch._dynamo.reset()
        step = torch.compile(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads.append([p.grad.float() for p in model.parameters()])
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max() + 1e-6
    assert per_sequence[1] < 0.6 * per_sequence[0]
