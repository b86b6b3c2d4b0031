"""One rank of a data-parallel job on a GPU (NCCL, world size 1): the captured step with the
gradients' all-reduce inside its graph trains as the single-process step does, moves nothing
and never waits."""

from __future__ import annotations

import socket

import pytest
import torch

from gpuflow.accounting.budgets import budget
from gpuflow.train import distributed
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import Ranks
from gpuflow.train.run import read_metrics
from gpuflow.train.step import GraphStep
from gpuflow.train.trainer import Trainer

from ..conftest import FAST

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank(accel, monkeypatch):
    if accel.type != "cuda":
        pytest.skip("data-parallel training on an accelerator runs on NCCL: cuda only")
    with socket.socket() as s:  # a free port for the process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ranks = Ranks(0, 1, 0, launched=True)
    distributed.start(ranks, accel)
    yield ranks
    distributed.stop()


def test_one_nccl_rank_captures_the_all_reduce_and_trains_as_one_process(
    accel, one_rank, prepared, workdir
):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    config = resolve_config("tiny", None, sets)
    alone = Trainer(config, workdir / "runs" / "alone", accel)
    alone.run()
    ranked = Trainer(config, workdir / "runs" / "rank", accel, ranks=one_rank)
    ranked.run()
    losses = {
        name: [r["loss"] for r in read_metrics(workdir / "runs" / name) if "loss" in r]
        for name in ("alone", "rank")
    }
    assert len(losses["rank"]) == 20
    assert losses["rank"] == pytest.approx(losses["alone"], rel=1e-3)
    assert ranked.averager is not None and ranked.averager.bytes_per_step > 0

    trainer = Trainer(config, workdir / "runs" / "budget", accel, ranks=one_rank)
    trainer.build(resume=False)
    with trainer.open_step(0, 20) as train_step:
        for step in range(6):  # warm-up and capture
            train_step(step)
        assert isinstance(train_step, GraphStep) and train_step.captured.graph is not None
        for step in range(6, 12):
            with budget(h2d_bytes=0, d2h_bytes=0, syncs=0, device_allocs=0):
                train_step(step)
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", ["resident", "standard"])
def test_one_nccl_rank_on_an_eager_path_trains_under_ddp_as_one_process(
    accel, one_rank, prepared, workdir, path
):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=12", "train.log_interval=1"]
    config = resolve_config("tiny", None, [*sets, f"train.data_path={path}"])
    alone = Trainer(config, workdir / "runs" / f"alone-{path}", accel)
    alone.run()
    ranked = Trainer(config, workdir / "runs" / f"rank-{path}", accel, ranks=one_rank)
    ranked.run()
    assert isinstance(ranked.forward, torch.nn.parallel.DistributedDataParallel) or isinstance(
        getattr(ranked.forward, "_orig_mod", None), torch.nn.parallel.DistributedDataParallel
    )
    losses = {
        name: [r["loss"] for r in read_metrics(workdir / "runs" / name) if "loss" in r]
        for name in (f"alone-{path}", f"rank-{path}")
    }
    assert len(losses[f"rank-{path}"]) == 12
    assert losses[f"rank-{path}"] == pytest.approx(losses[f"alone-{path}"], rel=1e-3)
