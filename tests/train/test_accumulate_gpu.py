"""Gradient accumulation on a GPU: the captured step sums its micro-batches inside the graph
(bf16 weights' gradients in fp32) and trains as one batch of their sum does, moving nothing
and never waiting; an automatic micro-batch is measured on the device."""

from __future__ import annotations

import pytest
import torch

from gpuflow.accounting.budgets import budget
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.step import GraphStep
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda(accel):
    if accel.type != "cuda":
        pytest.skip("the captured step and its bf16 weights are the CUDA path")
    return accel


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_the_captured_step_sums_micro_batches_as_one_batch(cuda, prepared, workdir):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1",
            "train.compile=true"]  # fmt: skip
    whole = Trainer(resolve_config("tiny", None, [*sets, "train.batch_size=8"]),
                    workdir / "runs" / "whole", cuda)  # fmt: skip
    whole.run()
    split_config = resolve_config(
        "tiny", None, [*sets, "train.batch_size=2", "train.batch_tokens=256"]
    )
    split = Trainer(split_config, workdir / "runs" / "split", cuda)
    split.run()
    assert split.setup.batching.accumulation == 4 and split.tokens_per_step == 256
    a, b = _losses(workdir / "runs" / "whole"), _losses(workdir / "runs" / "split")
    assert len(a) == len(b) == 20
    assert b == pytest.approx(a, rel=2e-2)  # the same windows; bf16 products summed otherwise
    assert b[-1] < b[0] - 0.5

    trainer = Trainer(split_config, workdir / "runs" / "budget", cuda)
    trainer.build(resume=False)
    with trainer.open_step(0, 20) as train_step:
        for step in range(6):  # warm-up and capture
            train_step(step)
        assert isinstance(train_step, GraphStep) and train_step.captured.graph is not None
        assert train_step.sum is not None  # bf16 weights: micro-batches summed in fp32
        for step in range(6, 12):  # four micro-batches a replay, nothing crossing or waiting
            with budget(h2d_bytes=0, d2h_bytes=0, syncs=0, device_allocs=0):
                train_step(step)
    torch.cuda.synchronize()


def test_an_automatic_micro_batch_is_measured_on_the_device(cuda, prepared, workdir, capsys):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=8", "train.log_interval=4",
            "train.batch_size=0", "train.batch_tokens=8192"]  # fmt: skip
    trainer = Trainer(resolve_config("tiny", None, sets), workdir / "runs" / "auto", cuda)
    trainer.run()
    batching = trainer.setup.batching
    # 256 sequences of 32 a step: the tiny model fits them all in one micro-batch
    assert (batching.micro_batch, batching.accumulation) == (256, 1)
    assert "the largest that fits the device" in capsys.readouterr().err


def test_the_memory_a_step_takes_grows_in_a_line_with_its_sequences(cuda):
    """The automatic micro-batch extends the peaks at 1 and 2 sequences in a line: at 8 the
    measured peak is within a tenth of the line's (GPT-2 small's context and vocabulary)."""
    from gpuflow.model.gpt import GPT, ModelConfig
    from gpuflow.train.batching import device_fit, peak_step_bytes

    config = ModelConfig(vocab_size=50304, n_layer=4, n_head=4, d_model=256, max_len=1024)
    model = GPT(config).to(cuda.torch)
    fit = device_fit(model, cuda, 1024, 50304, reserved=0)
    assert fit is not None and fit.per_sequence > 50e6  # activations of 1024 tokens, logits
    measured = peak_step_bytes(model, cuda, 1024, 50304, 8)
    assert measured == pytest.approx(fit.fixed + 8 * fit.per_sequence, rel=0.1)
    assert fit(1) and not fit(10**6)
