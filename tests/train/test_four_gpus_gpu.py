"""Jobs on four GPUs of one host: the split update's exchange over peer memory against
NCCL's all-reduce; the split update's state, held in parts, checkpointed whole
and resumed on any number of GPUs; two torchrun "nodes" of two GPUs each, which exchange
through NCCL alone, train, exit and resume."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuflow.train.checkpoint import latest_checkpoint, read_checkpoint
from gpuflow.train.runfolder import read_metrics, resumed_config
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST, child_env, gpuflow_cli, torchrun_cli, torchrun_ended

pytestmark = pytest.mark.gpu


@pytest.fixture
def four_gpus(accel):
    if accel.type != "cuda" or torch.cuda.device_count() < 4:
        pytest.skip("needs four CUDA GPUs")


def _args(prepared, name: str, steps: int, *sets: str) -> list[str]:
    sets = (*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=20",
            "train.checkpoint_interval=20", "train.decay_steps=100000",
            "train.batch_tokens=1024", *sets)  # fmt: skip
    return ["--name", name, "--steps", str(steps), *(a for s in sets for a in ("--set", s))]


def _job(workdir, nproc: int, *args: str) -> str:
    if nproc == 1:
        done = gpuflow_cli("train", *args, cwd=workdir)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        return out
    job = torchrun_cli(*args, cwd=workdir, nproc=nproc)
    out = torchrun_ended(job, workdir, timeout=300)
    assert job.returncode == 0, out
    return out


def _logged_steps(run) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


def _final_val(run) -> float:
    return [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_peer_exchange_averages_as_nccls_all_reduce(accel, tmp_path, nproc):
    """Each rank's part of the gradients, pushed by every rank into its buffer and averaged
    there, is NCCL's mean of them bit for bit (bf16 sums of so few terms are exact in
    fp32); the clip's norm and the loss are the whole mean's; a second step's gradients
    replace the first's. A meet that only rank 0 comes to holds its GPU until it leaves the
    job (as a survivor of a killed rank does), then lets it go."""
    if accel.type != "cuda" or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    worker = Path(__file__).with_name("sharded_exchange_gpu_worker.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(worker), str(tmp_path)],
        env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(nproc):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["exchange"] == "gradients by peer writes, weights by peer writes", found
        for step in found["steps"]:
            assert step["part_equal"], (rank, step)
            assert step["norm"] == pytest.approx(step["want_norm"], rel=1e-5), (rank, step)
            assert step["loss"] == step["want_loss"], (rank, step)
    lone = json.loads((tmp_path / "rank0.json").read_text())["lone_meet_s"]
    assert 1.0 <= lone < 10.0, lone


@pytest.mark.parametrize("saved_on,resumed_on", [(4, 1), (4, 2), (2, 4)])
def test_a_state_split_over_gpus_is_checkpointed_whole_and_resumes_on_any_count(
    accel, four_gpus, prepared, workdir, saved_on, resumed_on
):
    _job(workdir, saved_on, *_args(prepared, "split", 20))
    run = workdir / "runs" / "split"
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == saved_on and "peer" in report["exchange"], report
    # Rank 0 gathered every rank's part: its checkpoint's masters give, on one GPU, the
    # validation loss the job measured, and no rank's part of the moments is left empty.
    trainer = Trainer(resumed_config(run, steps=21), run, accel)
    trainer.build(resume=True)
    assert trainer.setup.start_step == 20
    assert trainer.evaluate() == pytest.approx(_final_val(run), rel=1e-5)
    moments = read_checkpoint(latest_checkpoint(run)).moments
    second = torch.cat([v.flatten() for k, v in sorted(moments.items()) if "exp_avg_sq" in k])
    for part in second.chunk(saved_on):
        assert part.count_nonzero() > 0.9 * part.numel()
    out = _job(workdir, resumed_on, "--resume", *_args(prepared, "split", 26))
    assert "finished at step 26" in out, out
    assert _logged_steps(run) == list(range(2, 27, 2))
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert losses[-1] < 1.1 * losses[9]  # the moments and masters carried on, not restarted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(workdir, *args: str) -> list[str]:
    """``torchrun --nnodes 2 --nproc_per_node 2`` twice on this host, each "node" seeing
    two of its GPUs; both nodes' output, once both have ended (exit 0)."""
    port = _free_port()
    jobs = []
    for node, gpus in enumerate(("0,1", "2,3")):
        env = child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                         "CUDA_VISIBLE_DEVICES": gpus})  # fmt: skip
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
            "--nproc_per_node=2", f"--node_rank={node}", "--master_addr=127.0.0.1",
            f"--master_port={port}", "-m", "gpuflow", "train", *args,
        ]  # fmt: skip
        log = open(workdir / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        jobs.append((subprocess.Popen(command, cwd=workdir, env=env, stdout=log,
                                      stderr=subprocess.STDOUT), log))  # fmt: skip
    outs = []
    for node, (job, log) in enumerate(jobs):
        try:
            job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
            log.close()
        out = (workdir / f"node{node}.log").read_text()
        assert job.returncode == 0, out
        outs.append(out)
    return outs


def test_two_nodes_of_two_gpus_exchange_through_nccl_train_exit_and_resume(
    four_gpus, prepared, workdir
):
    outs = _two_nodes(workdir, *_args(prepared, "nodes", 20))
    run = workdir / "runs" / "nodes"
    assert "finished at step 20" in outs[0], outs
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == 4
    # no peer memory across hosts: the ranks of two nodes exchange through NCCL alone
    assert report["exchange"] == "gradients by NCCL reduce-scatter, weights by NCCL all-gather"
    assert len(report["peak_device_bytes_per_rank"]) == 4
    outs = _two_nodes(workdir, "--resume", *_args(prepared, "nodes", 26))
    assert "finished at step 26" in outs[0], outs
    assert _logged_steps(run) == list(range(2, 27, 2))
    # the same job on one "node" of four GPUs uses their peer memory
    shutil.rmtree(run)
    _job(workdir, 4, *_args(prepared, "nodes", 6))
    report = json.loads((run / "report.json").read_text())
    assert report["exchange"] == "gradients by peer writes, weights by peer writes", report
