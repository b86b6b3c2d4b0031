"""The baseline data paths on the cpu: ``standard`` hands the step the batch the sampler drew,
as int64 shifted by one; ``naive`` keeps it on the host and its per-sequence gradients are the
model's own. Importing them registers their rows and the naive step with the trainer, and a
run asking for one that is not registered is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.bench.baselines.naive import (
    STEP_KIND,
    NaiveBatches,
    NaiveStep,
    naive_gradients,
    naive_update,
)
from gpuflow.bench.baselines.standard import StandardBatches
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.batches import WindowSampler
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train.config import resolve_config
from gpuflow.train.datapath import PATHS, DataPath, StepKind, register_path, registered, row
from gpuflow.train.step import STEPS, register_step
from gpuflow.train.trainer import Trainer
from tests.helpers import random_shards

CPU = Device("cpu")


def _sampler(tmp_path, batch_size: int = 4, seq_len: int = 16) -> WindowSampler:
    shards = random_shards(tmp_path, [500, 300], np.uint16, 64)
    return WindowSampler(tuple(shards), batch_size, seq_len, seed=3)


def test_standard_batches_are_the_samplers_windows_as_int64_inputs_and_targets(tmp_path):
    sampler = _sampler(tmp_path)
    batches = StandardBatches(sampler, CPU)
    assert batches.reads_loss_each_log  # a logging step reads its loss with .item()
    for step in (0, 1, 7):
        x, y = batches.inputs(step)
        window = torch.from_numpy(sampler.batch(step).astype(np.int64))  # (B, T+1)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
        assert torch.equal(x, window[:, :-1]) and torch.equal(y, window[:, 1:])
    x0, _ = batches.inputs(0)
    assert torch.equal(x0, batches.inputs(0)[0])  # a step's batch is fixed by the seed
    assert not torch.equal(x0, batches.inputs(1)[0])


def test_naive_batches_stay_on_the_host_and_its_gradients_are_the_models_own(tmp_path):
    torch.manual_seed(0)
    sampler = _sampler(tmp_path, batch_size=3, seq_len=8)
    host = NaiveBatches(sampler).host_tokens(5)
    assert isinstance(host, np.ndarray) and host.dtype == np.int64 and host.shape == (3, 9)
    model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, max_len=8))
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())

    loss = naive_gradients(model, CPU, host)  # each sequence alone, embedded on the host
    tokens = torch.from_numpy(host)
    expected = reference(tokens[:, :-1], tokens[:, 1:])  # the whole batch at once
    expected.backward()
    assert torch.allclose(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad, rtol=1e-4, atol=1e-6), name


def test_the_naive_update_clips_steps_and_clears_as_a_plain_loop_does():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    for net in (model, twin):
        (net(torch.ones(2, 4)).sum() * 100).backward()  # large gradients: the clip bites
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    norm = naive_update(model, optimizer, grad_clip=0.5)
    assert torch.equal(norm, expected_norm) and norm > 0.5  # the norm before the clip
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert mine.grad is None
    (model(torch.ones(2, 4)).sum()).backward()
    unclipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    norm = naive_update(model, optimizer, grad_clip=0.0)  # not clipped, still logged
    assert norm > 0 and torch.allclose(norm, unclipped)


def test_importing_the_baselines_registers_their_rows_and_the_naive_step():
    assert registered("naive") and registered("standard")
    assert row(DataPath.NAIVE).step == STEP_KIND and STEPS[STEP_KIND] is NaiveStep
    assert row(DataPath.STANDARD).step == StepKind.EAGER and row(DataPath.STANDARD).ddp
    with pytest.raises(ValueError, match="the trainer's own"):
        register_path(DataPath.RESIDENT, row(DataPath.NAIVE))
    with pytest.raises(ValueError, match="the trainer's own kinds"):
        register_step(StepKind.EAGER, NaiveStep)


def test_a_run_asking_for_an_unregistered_baseline_is_refused_in_one_line(tmp_path, monkeypatch):
    for baseline in (DataPath.NAIVE, DataPath.STANDARD):
        monkeypatch.delitem(PATHS, baseline)  # as in a process that never imported the bench
    assert not registered("naive") and registered("auto") and registered("resident")
    config = resolve_config("tiny", None, ["train.data_path=naive"])
    with pytest.raises(GpuflowError) as refused:
        Trainer(config, tmp_path / "run", CPU).run()
    message = str(refused.value)
    assert "\n" not in message
    assert "import gpuflow.bench.baselines" in message
    assert "gpuflow bench train --modes naive" in message
    assert not (tmp_path / "run").exists()  # refused before the run's folder was made
