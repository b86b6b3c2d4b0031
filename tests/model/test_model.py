"""The GPT: shapes, causality, tied head, initial loss and the FLOP count."""

from __future__ import annotations

import math

import torch

from gpuflow.model.gpt import GPT, ModelConfig, flops_per_token

SMALL = ModelConfig(vocab_size=300, n_layer=2, n_head=4, d_model=32, max_len=16)


def test_initial_loss_is_near_uniform_guessing():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (4, 16))
    loss = model(idx, torch.roll(idx, -1, dims=1))
    assert loss.dtype == torch.float32
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.3


def test_prediction_at_t_ignores_later_tokens():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    idx = torch.randint(0, SMALL.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a = model.hidden(idx)
        b = model.hidden(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_output_head_is_the_token_table():
    model = GPT(SMALL)
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)
    idx = torch.randint(0, SMALL.vocab_size, (2, 5))
    with torch.no_grad():
        expected = model.hidden(idx)[:, -1] @ model.wte.weight.T
    torch.testing.assert_close(model.next_token_logits(idx), expected)


def test_flops_per_token_formula():
    config = ModelConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, max_len=1024)
    n = 50304 * 768 + 12 * 12 * 768 * 768  # token table (it is the head) + blocks' matrices
    assert flops_per_token(config) == 6 * n + 12 * 12 * 768 * 1024
    model = GPT(config)
    non_matmul = 1024 * 768 + (2 * 12 + 1) * 768  # position table and LayerNorm gains
    assert model.parameter_count() == n + non_matmul


def test_residual_stream_takes_autocast_dtype_and_the_loss_stays_close():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (4, 16))
    targets = torch.roll(idx, -1, dims=1)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    exact = model(idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(idx, targets)
    assert seen == [torch.float32, torch.bfloat16]
    assert mixed.dtype == torch.float32
    assert abs(mixed.item() - exact.item()) < 0.02 * exact.item()
    mixed.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_recomputed_blocks_give_the_same_gradients_and_keep_less_for_the_backward():
    config = ModelConfig(vocab_size=96, n_layer=3, n_head=2, d_model=32, max_len=24)
    ids = torch.randint(96, (4, 25), generator=torch.Generator().manual_seed(0))
    grads, kept = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        model.recompute_blocks = recompute
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        kept.append(sum(saved))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6)
    assert kept[1] < 0.5 * kept[0]  # each block's input, not its activations
