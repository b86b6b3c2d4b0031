"""MasterAdamW: bf16 weights over fp32 masters, checkpointed as plain AdamW."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train.config import TrainConfig
from gpuflow.train.optim.adamw import build_optimizer, decay_groups
from gpuflow.train.optim.master_adamw import MasterAdamW
from tests.helpers import load_checkpoint, save_checkpoint

SHAPES = [(40, 24), (24,), (7, 9)]  # 63 elements: a size that is not a multiple of 8


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(decay_groups(params, 0.1), lr=1e-2)  # torch's betas: 0.9, 0.999


def test_the_step_is_adamw_on_the_fp32_masters():
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [torch.nn.Parameter(x.clone()) for x in start]
    reference = [torch.nn.Parameter(x.clone()) for x in start]
    taken_over, ref = _adamw(ours), _adamw(reference)
    first = [torch.randn(s, generator=g) for s in SHAPES]
    for p, q, grad in zip(ours, reference, first, strict=True):  # moments to take over
        p.grad, q.grad = grad.clone(), grad.clone()
    taken_over.step()
    ref.step()

    opt = MasterAdamW(taken_over)
    for p in ours:
        assert p.dtype == torch.bfloat16
        assert (
            opt.weights.data_ptr()
            <= p.data_ptr()
            < opt.weights.data_ptr() + 2 * opt.weights.numel()
        )
    scale = torch.tensor(1.7)
    for _ in range(3):
        for p, q in zip(ours, reference, strict=True):
            grad = torch.randn(p.shape, generator=g).bfloat16()
            p.grad = grad
            q.grad = grad.float() / scale
        opt.grad_scale = scale
        opt.step()
        ref.step()
    index = {id(p): i for i, p in enumerate(p for gr in opt.param_groups for p in gr["params"])}
    for p, q in zip(ours, reference, strict=True):
        master = opt.master_of(index[id(p)])
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.bfloat16())  # the copy the model reads


def _train(model: GPT, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        model(batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_checkpoints_keep_the_masters_and_resume_the_same_run(tmp_path):
    cpu = Device("cpu")
    config = ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_len=16)
    train = TrainConfig(lr=3e-3)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(4)]

    torch.manual_seed(0)
    model = GPT(config)
    opt = MasterAdamW(build_optimizer(model, train, cpu))
    _train(model, opt, batches[:2])
    saved = save_checkpoint(tmp_path, 2, model, opt, {"note": "test"}, keep=2)
    masters = {n: t.clone() for n, t in opt.full_precision_state(model).items()}
    _train(model, opt, batches[2:])

    weights = load_file(str(saved / "model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert all(torch.equal(weights[n], masters[n]) for n in masters)
    # The bf16 copies alone would have lost the low bits that the masters keep.
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())

    # Resumed into torch's AdamW (any device can), then taken over again: the same run.
    torch.manual_seed(0)
    again = GPT(config)
    adamw = build_optimizer(again, train, cpu)
    load_checkpoint(saved, again, adamw)
    assert float(adamw.state[again.wte.weight]["step"]) == 2.0
    resumed = MasterAdamW(adamw)
    _train(again, resumed, batches[2:])
    for n, t in resumed.full_precision_state(again).items():
        assert torch.equal(t, opt.full_precision_state(model)[n]), n


def test_the_optimizer_is_handed_over_once_and_only_for_a_bf16_step(monkeypatch):
    from gpuflow.train.optim.master_adamw import with_fp32_masters

    adamw = _adamw([torch.nn.Parameter(torch.randn(s)) for s in SHAPES])
    cpu = Device("cpu")
    assert with_fp32_masters(adamw, cpu) is adamw  # no kernel, no bf16 autocast here
    monkeypatch.setattr(MasterAdamW, "runs_on", staticmethod(lambda device: True))
    monkeypatch.setattr(Device, "supports_bf16_autocast", property(lambda self: True))
    taken = with_fp32_masters(adamw, cpu)
    assert isinstance(taken, MasterAdamW)
    assert with_fp32_masters(taken, cpu) is taken  # a second stepper keeps the masters


def test_the_gradient_norm_of_bf16_gradients_is_summed_in_fp32():
    from gpuflow.train.optim.adamw import global_grad_norm

    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(s, generator=g).bfloat16() for s in [(300, 64), (64,), (5000,)]]
    exact = torch.cat([t.double().flatten() for t in grads]).norm().item()
    norm = global_grad_norm(grads)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(exact, rel=1e-5)  # a bf16 result is 4e-3 off here


def test_the_hand_over_reads_every_step_counter_in_one_read(monkeypatch):
    import gpuflow.train.optim.master_adamw as module

    reads = []
    real_read = module.read_now
    monkeypatch.setattr(module, "read_now", lambda t: reads.append(t.numel()) or real_read(t))
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    adamw = _adamw(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        adamw.step()
    opt = MasterAdamW(adamw)
    assert reads == [len(SHAPES)]  # one read of all three counters, not one per parameter
    assert opt.step_count.item() == 2


def test_weights_placed_in_another_buffer_are_the_ones_the_model_sees_and_the_step_writes():
    """``place_weights`` (memory the other ranks map, on CUDA): the parameters become views of
    the new buffer, their values kept, and the update writes there."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = MasterAdamW(_adamw(params))
    before = [p.detach().clone() for p in params]
    buffer = torch.full_like(opt.weights, float("nan"))
    opt.place_weights(buffer)
    assert opt.weights is buffer
    for p, old in zip(params, before, strict=True):
        assert buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.nbytes
        assert torch.equal(p.detach(), old)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(buffer, opt.master.bfloat16())
    assert not any(torch.equal(p.detach(), old) for p, old in zip(params, before, strict=True))
    with pytest.raises(ValueError, match="bf16 buffer"):
        opt.place_weights(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 buffer"):
        opt.gradient_buffer(torch.zeros_like(opt.master))  # fp32: not the weights' layout
    flat, views = opt.gradient_buffer(torch.ones_like(buffer))
    assert not flat.any()
    assert [v.shape for v in views] == [p.shape for p in opt.params]
