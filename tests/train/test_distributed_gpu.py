"""Data-parallel jobs on GPUs. One NCCL rank (world size 1): the captured step with the
gradients' all-reduce inside its graph trains as the single-process step does, moves nothing
and never waits. Two GPUs under torchrun: a job ends within seconds of finishing, of a
signal or of a rank's death, and resumes on two GPUs and on one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest
import torch

import gpuflow.bench.baselines  # noqa: F401  (registers the naive and standard paths)
from gpuflow.accounting.budgets import budget
from gpuflow.train import distributed
from gpuflow.train.checkpoint import latest_checkpoint, read_record
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import Ranks
from gpuflow.train.runfolder import read_metrics, resumed_config
from gpuflow.train.step import GraphStep
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST, gpuflow_cli, torchrun_cli, torchrun_ended, torchrun_workers

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
    averager = ranked.setup.averager
    assert averager is not None and averager.bytes_per_step > 0

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
    forward = ranked.setup.forward
    assert isinstance(forward, torch.nn.parallel.DistributedDataParallel) or isinstance(
        getattr(forward, "_orig_mod", None), torch.nn.parallel.DistributedDataParallel
    )
    losses = {
        name: [r["loss"] for r in read_metrics(workdir / "runs" / name) if "loss" in r]
        for name in (f"alone-{path}", f"rank-{path}")
    }
    assert len(losses[f"rank-{path}"]) == 12
    assert losses[f"rank-{path}"] == pytest.approx(losses[f"alone-{path}"], rel=1e-3)


# ---- two GPUs: torchrun -m gpuflow train --------------------------------------------------


@pytest.fixture
def two_gpus(accel):
    if accel.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")


def _two_gpu_args(prepared, name: str, steps: int, *sets: str) -> list[str]:
    sets = (*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=1000",
            "train.checkpoint_interval=20", "train.decay_steps=100000", *sets)  # fmt: skip
    return ["--name", name, "--steps", str(steps), *(a for s in sets for a in ("--set", s))]


def _wait_for(what, job, workdir, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        log = (workdir / "torchrun.log").read_text()
        assert job.poll() is None, log
        assert time.monotonic() < deadline, log
        time.sleep(0.2)


def _ends_within(job, workdir, seconds: float) -> str:
    """The job's output once it has ended, which it must within ``seconds``."""
    try:
        return torchrun_ended(job, workdir, timeout=seconds)
    except subprocess.TimeoutExpired:
        for pid in torchrun_workers(job).values():
            os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait()
        log = (workdir / "torchrun.log").read_text()
        raise AssertionError(f"the job did not end within {seconds} s:\n{log}") from None


def _logged_steps(run) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


@pytest.mark.parametrize(
    "path,compiled",
    [("resident-graph", True), ("resident-graph", False), ("standard", False)],
)
def test_a_two_gpu_job_exits_within_seconds_of_finishing(
    accel, two_gpus, prepared, workdir, path, compiled
):
    """Every rank leaves the process group and the job ends: the captured all-reduce's graph
    no longer keeps NCCL's communicator, and so the job, from ending."""
    sets = [f"train.data_path={path}", f"train.compile={str(compiled).lower()}"]
    job = torchrun_cli(*_two_gpu_args(prepared, "done", 40, *sets), cwd=workdir)
    _wait_for(lambda: "finished at step 40" in (workdir / "torchrun.log").read_text(), job,
              workdir, timeout=300)  # fmt: skip
    out = _ends_within(job, workdir, 20)
    assert job.returncode == 0, out
    run = workdir / "runs" / "done"
    assert _logged_steps(run) == list(range(2, 41, 2))
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == 2 and report["collective_bytes_per_step_per_rank"] > 0
    if path == "resident-graph":  # the largest over both ranks, every sampled step
        bus = [r for r in read_metrics(run) if "h2d_bytes_per_step" in r]
        assert bus, out
        for field in ("h2d_bytes_per_step", "syncs_per_step", "device_allocs_per_step"):
            assert max(r[field] for r in bus) == 0, (field, bus)
        # Each rank updated half the weights; the last checkpoint holds both halves: on
        # this one GPU its weights give the validation loss rank 0 measured at the end.
        trainer = Trainer(resumed_config(run, steps=41), run, accel)
        trainer.build(resume=True)
        assert trainer.setup.start_step == 40
        final_val = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]
        assert trainer.evaluate() == pytest.approx(final_val, rel=1e-5)


@pytest.mark.parametrize("path", ["resident-graph", "standard"])
def test_a_two_gpu_job_sums_micro_batches_and_exchanges_once_a_step(
    two_gpus, prepared, workdir, path
):
    """Four micro-batches of 2 on each GPU train as one batch of 8 does (the same windows),
    and the ranks exchange the same bytes a step: once per step, not once per micro-batch
    (inside the captured step's graph, or DDP's all-reduce held back until the last)."""
    reports, losses = {}, {}
    for name, batch in (("whole", ["train.batch_size=8"]),
                        ("split", ["train.batch_size=2", "train.batch_tokens=512"])):  # fmt: skip
        sets = [f"train.data_path={path}", "train.compile=true", *batch]
        job = torchrun_cli(*_two_gpu_args(prepared, name, 12, *sets), cwd=workdir)
        out = _ends_within(job, workdir, 300)
        assert job.returncode == 0, out
        reports[name] = json.loads((workdir / "runs" / name / "report.json").read_text())
        losses[name] = [r["loss"] for r in read_metrics(workdir / "runs" / name) if "loss" in r]
    assert reports["split"]["accumulation"] == 4 and reports["split"]["tokens_per_step"] == 512
    assert reports["whole"]["tokens_per_step"] == 512
    exchanged = [reports[n]["collective_bytes_per_step_per_rank"] for n in ("whole", "split")]
    assert exchanged[0] > 0 and exchanged[1] == exchanged[0]
    assert losses["split"] == pytest.approx(losses["whole"], rel=2e-2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_two_gpu_job_stops_on_a_signal_with_a_checkpoint_and_resumes(
    two_gpus, prepared, workdir, sig
):
    """Ctrl-C (torchrun passes it on) or SIGTERM: every rank stops after the same step, rank 0
    checkpoints it, the job ends non-zero within seconds; resumed on 2 GPUs, the run logs
    every step once."""
    job = torchrun_cli(*_two_gpu_args(prepared, "sig", 100000), cwd=workdir)
    run = workdir / "runs" / "sig"
    _wait_for(lambda: latest_checkpoint(run) is not None, job, workdir)
    job.send_signal(sig)
    started = time.monotonic()
    out = _ends_within(job, workdir, 30)
    assert job.returncode != 0, out
    assert time.monotonic() - started < 15, out
    assert "interrupted: saved" in out and "--resume" in out, out
    saved = read_record(latest_checkpoint(run))["step"]
    assert saved > 20  # the stop step's own checkpoint, not only the first interval's
    job = torchrun_cli("--resume", *_two_gpu_args(prepared, "sig", saved + 6), cwd=workdir)
    out = _ends_within(job, workdir, 240)
    assert job.returncode == 0 and f"finished at step {saved + 6}" in out, out
    assert _logged_steps(run) == list(range(2, saved + 7, 2))


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_gpu_rank_ends_the_job_and_it_resumes_on_two_gpus_and_on_one(
    two_gpus, prepared, workdir, victim
):
    """kill -9 of either rank: the other stops within seconds (not after NCCL's timeout),
    says why in one line, and the run resumes from its last checkpoint on 2 GPUs, then on
    1, logging every step once."""
    job = torchrun_cli(*_two_gpu_args(prepared, "kill", 100000), cwd=workdir)
    run = workdir / "runs" / "kill"
    _wait_for(lambda: latest_checkpoint(run) is not None, job, workdir)
    os.kill(torchrun_workers(job)[victim], signal.SIGKILL)
    started = time.monotonic()
    out = _ends_within(job, workdir, 60)
    assert job.returncode != 0, out
    assert time.monotonic() - started < 15, out
    assert "another rank of this job stopped or died" in out, out
    saved = read_record(latest_checkpoint(run))["step"]
    job = torchrun_cli("--resume", *_two_gpu_args(prepared, "kill", saved + 6), cwd=workdir)
    out = _ends_within(job, workdir, 240)
    assert job.returncode == 0 and f"finished at step {saved + 6}" in out, out
    one = gpuflow_cli("train", "--resume", *_two_gpu_args(prepared, "kill", saved + 12),
                      cwd=workdir)  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    assert _logged_steps(run) == list(range(2, saved + 13, 2))
