"""The optimizers' contract with the step (``gpuflow.train.optim.StepOptimizer``): both
optimizers keep every part of it."""

from __future__ import annotations

import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train.config import TrainConfig
from gpuflow.train.optim import StepOptimizer
from gpuflow.train.optim.adamw import CapturableAdamW, build_optimizer
from gpuflow.train.optim.master_adamw import MasterAdamW


def _contract() -> set[str]:
    """The names StepOptimizer asks for: its attributes and its methods."""
    methods = {
        name
        for name, value in vars(StepOptimizer).items()
        if callable(value) and not name.startswith("_")
    }
    return methods | set(StepOptimizer.__annotations__)


def test_the_contract_names_the_steps_needs():
    assert _contract() == {
        "param_groups", "defaults", "grad_scale", "step", "zero_grad", "state_dict",
        "load_state_dict", "use_device_lr", "after_capture", "gather_state",
    }  # fmt: skip


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, max_len=8))


@pytest.mark.parametrize("kind", ["adamw", "master"])
def test_each_optimizer_keeps_the_contract_and_takes_a_step(kind):
    model = _model()
    if kind == "master":
        model = model.to(torch.bfloat16)
    optimizer = build_optimizer(model, TrainConfig(), Device("cpu"))
    assert isinstance(optimizer, CapturableAdamW)
    if kind == "master":
        optimizer = MasterAdamW(optimizer)  # takes the AdamW over, on fp32 masters
    missing = {name for name in _contract() if not hasattr(optimizer, name)}
    assert missing == set()
    assert optimizer.grad_scale is None or isinstance(optimizer.grad_scale, torch.Tensor)
    before = [p.detach().clone() for p in model.parameters()]
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx).backward()
    optimizer.step()
    optimizer.zero_grad()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    assert any(moved)
    assert all(p.grad is None for p in model.parameters())
    optimizer.gather_state()  # one rank: already whole
    assert optimizer.state_dict()["param_groups"]
