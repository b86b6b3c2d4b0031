"""The same behaviour on a real accelerator: run with `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.device import Device
from gpuflow.linkprobe import probe_link
from gpuflow.loader import upload_tokens
from gpuflow.mirror import AsyncScalars, host_snapshot
from gpuflow.model import GPT
from gpuflow.sample import SampleConfig, sample
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.run import read_metrics
from gpuflow.train.trainer import Trainer

from .conftest import FAST

pytestmark = pytest.mark.gpu


@pytest.fixture
def accel() -> Device:
    return Device.resolve("auto")


def test_token_ids_cross_narrow_and_widen_on_the_device(accel):
    rng = np.random.default_rng(0)
    for dtype, high in ((np.uint16, 1 << 16), (np.uint32, 1 << 20)):
        host = rng.integers(0, high, size=(8, 129), dtype=np.int64).astype(dtype)
        host[0, 0] = high - 1  # the largest id must not wrap to a negative int
        on_device = upload_tokens(host, accel)
        assert on_device.device.type == accel.type and on_device.dtype == torch.int64
        assert np.array_equal(on_device.cpu().numpy(), host.astype(np.int64))


def test_async_scalars_arrive_late_but_exact(accel):
    scalars = AsyncScalars(("a", "b"), accel, depth=2)
    got = []
    for interval in range(1, 6):
        for i in range(4):
            v = torch.tensor(float(interval * 10 + i), device=accel.torch)
            scalars.add(a=v, b=v * 2)
        got += scalars.flush(interval)
    got += scalars.drain(6)
    assert [tag for tag, _ in got] == [1, 2, 3, 4, 5]
    for tag, means in got:
        assert means["a"] == pytest.approx(tag * 10 + 1.5)
        assert means["b"] == pytest.approx(2 * (tag * 10 + 1.5))


def test_host_snapshot_copies_every_byte(accel):
    tensors = {f"t{i}": torch.randn(1000 + i, device=accel.torch) for i in range(5)}
    snap = host_snapshot(tensors)
    for name, t in tensors.items():
        assert snap[name].device.type == "cpu"
        assert torch.equal(snap[name], t.cpu())


def test_link_probe_measures_every_copy_kind(accel):
    rates = probe_link(accel, nbytes=16 << 20, repeats=3)
    assert set(rates) == {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "d2d"}
    assert all(r > 0.1 for r in rates.values())
    if accel.type == "cuda":
        assert rates["h2d_pinned"] > rates["h2d_pageable"] * 0.9
        assert rates["d2d"] > rates["h2d_pinned"]


def test_training_on_the_accelerator_learns_and_resumes_on_the_cpu(accel, prepared, workdir):
    config = resolve_config(
        "tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=60", "train.eval_interval=60"]
    )
    result = Trainer(config, workdir / "runs" / "g", accel).run()
    val = [r["val_loss"] for r in read_metrics(result.run_dir) if "val_loss" in r]
    assert val[-1] < val[0] - 0.5
    assert result.device["type"] == accel.type
    # A checkpoint written on the accelerator (fused AdamW state there) resumes on the cpu.
    more = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=64"])
    resumed = Trainer(more, result.run_dir, Device("cpu")).run(resume=True)
    assert (resumed.start_step, resumed.last_step) == (60, 64)


def test_fused_adamw_and_bf16_autocast_are_used(accel, prepared, workdir):
    if accel.type != "cuda":
        pytest.skip("fused AdamW is the CUDA path")
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=2"])
    Trainer(config, workdir / "runs" / "f", accel).run()
    model = GPT(config.model).to(accel.torch)
    with accel.autocast():
        logits = torch.nn.functional.linear(
            model.hidden(torch.zeros(1, 4, dtype=torch.long, device=accel.torch)), model.wte.weight
        )
    assert logits.dtype == torch.bfloat16
    state = ckpt.latest_checkpoint(workdir / "runs" / "f") / "state.json"
    assert '"fused": true' in state.read_text()


def test_sample_on_the_accelerator(accel, prepared, workdir):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=5"])
    Trainer(config, workdir / "runs" / "s", accel).run()
    text = sample(workdir / "runs" / "s", SampleConfig(prompt="Return", max_tokens=20), accel)
    assert text.startswith("Return")
