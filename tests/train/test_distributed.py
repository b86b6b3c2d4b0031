"""Data-parallel training on the cpu with gloo: ranks from the environment, gradients
averaged over ranks, and ``torchrun -m gpuflow train`` with 2 processes (rank 0 writes,
checkpoints resume on 1 and on 2 ranks, a killed rank stops the job)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import nullcontext, suppress
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gpuflow.common.errors import GpuflowError
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train import distributed
from gpuflow.train.accumulate import accumulated_loss
from gpuflow.train.checkpoint import latest_checkpoint, read_record
from gpuflow.train.distributed import GradientAverager, RankLost, Ranks, agree, largest
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.step import Update
from tests.helpers import FAST, gpuflow_cli, torchrun_cli, torchrun_ended, torchrun_workers

B, T = 4, 16


def test_ranks_come_from_torchruns_environment():
    assert Ranks.from_env({}) == Ranks(0, 1, 0)
    assert not Ranks.from_env({}).distributed
    ranks = Ranks.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (ranks.rank, ranks.world_size, ranks.local_rank) == (3, 4, 1)
    assert ranks.distributed and not ranks.is_main
    one = Ranks.from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert one.distributed and one.is_main  # torchrun with one process runs the job's machinery
    with pytest.raises(GpuflowError, match="but not LOCAL_RANK"):
        Ranks.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(GpuflowError, match="must be integers"):
        Ranks.from_env({"RANK": "a", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(GpuflowError, match="not in a world of 2"):
        Ranks.from_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert ranks.one_host  # no LOCAL_WORLD_SIZE: one host
    node = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert not Ranks.from_env(node).one_host  # two nodes of two: no peer memory across
    assert Ranks.from_env({**node, "LOCAL_WORLD_SIZE": "4"}).one_host
    with pytest.raises(GpuflowError, match="LOCAL_WORLD_SIZE 1 must exceed LOCAL_RANK 1"):
        Ranks.from_env({**node, "LOCAL_WORLD_SIZE": "1"})


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, max_len=T))


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2 * B, T + 1), generator=generator)  # (2B, T+1)


def _one_update(
    model: GPT, tokens: torch.Tensor, averager: GradientAverager | None,
    forward: torch.nn.Module | None = None, micro_batches: int = 1,
) -> dict:  # fmt: skip
    """One clipped SGD step on ``tokens`` (in ``micro_batches`` parts, their gradients
    summed): the loss, grad norm and weights after it (SGD: the weights then move by the
    gradients themselves, which AdamW's first step would reduce to their signs)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = accumulated_loss(
        forward or model, tokens[:, :-1], tokens[:, 1:], micro_batches, nullcontext
    )
    grad_norm = Update(model, optimizer, 0.05, fused_clip=False, averager=averager)(loss)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "weights": weights}


def _rank_update(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        half = _batch()[rank * B : (rank + 1) * B]  # (B, T+1): this rank's rows
        averager = GradientAverager(2)
        result = _one_update(_model(), half, averager)
        result["bytes_per_step"] = averager.bytes_per_step
        result["agreed"] = agree(rank == 1, Ranks(rank, 2, rank))
        result["largest"] = largest(
            {"syncs": float(rank), "bytes": 8.0 - rank}, Ranks(rank, 2, rank)
        )
        # The eager paths' way: DDP averages the gradients in the backward, the loss alone
        # is left to the averager.
        model = _model()
        ddp = DistributedDataParallel(model)
        result["ddp"] = _one_update(model, half, GradientAverager(2, False), forward=ddp)
        # Two micro-batches a step under DDP: the gradients are exchanged once, after the
        # second (counted by a communication hook that all-reduces as DDP's own does).
        model = _model()
        ddp_accumulating = DistributedDataParallel(model)
        exchanges = []

        def counted(state, bucket):
            exchanges.append(bucket.buffer().numel())
            return allreduce_hook(state, bucket)

        ddp_accumulating.register_comm_hook(dist.group.WORLD, counted)
        result["accumulated"] = _one_update(
            model, half, GradientAverager(2, False), forward=ddp_accumulating, micro_batches=2
        )
        result["exchanged"] = exchanges
        torch.save(result, f"{out}.{rank}")
        # DDP's reducer let go while the group still lives and the ranks agree nothing is in
        # flight: a reducer freed at the process's exit destroys the group holding the
        # interpreter lock, while gloo's worker thread waits for that lock to free a finished
        # all-reduce, and the child hangs (seen in a CI run).
        del ddp, ddp_accumulating
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _on_two_ranks(worker, tmp_path) -> list:
    """Run ``worker(rank, store, out)`` on two gloo ranks; what each saved to ``out.<rank>``."""
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2)
    return [torch.load(tmp_path / f"out.{r}") for r in range(2)]


def test_two_ranks_step_as_one_process_with_the_doubled_batch(tmp_path):
    ranks = _on_two_ranks(_rank_update, tmp_path)
    whole = _one_update(_model(), _batch(), None)
    for result in [*ranks, *(r["ddp"] for r in ranks), *(r["accumulated"] for r in ranks)]:
        # The mean loss of two equal halves is the whole batch's; the clip (active at 0.05)
        # saw the global norm; the weights moved as one process's did. Within float32's
        # rounding: a CI host's kernels summed the halves' rows in another order (1.4e-6).
        assert result["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert result["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
        assert whole["grad_norm"] > 0.05
        for name, weight in whole["weights"].items():
            torch.testing.assert_close(result["weights"][name], weight, rtol=1e-5, atol=1e-6)
    parameters = sum(p.numel() for p in _model().parameters())
    for result in ranks:
        # one exchange of every gradient a step, not one per micro-batch
        assert sum(result["exchanged"]) == parameters
        assert result["bytes_per_step"] >= 4 * (parameters + 1)  # fp32 gradients and the loss
        assert result["bytes_per_step"] < 4 * (parameters + 1) + 16 * len(whole["weights"])
        assert result["agreed"] is True  # rank 1 asked: both ranks hear it
        assert result["largest"] == {"syncs": 1.0, "bytes": 8.0}  # each figure's largest
    assert ranks[0]["weights"].keys() == whole["weights"].keys()


SPLIT_SHAPES = [(40, 24), (24,), (7, 9), (70, 64)]  # one not a multiple of 8, one over a block


def _split_gradients(step: int, rank: int) -> list[torch.Tensor]:
    """Multiples of 1/64 below 1/8: a mean of two is exact in bf16, whatever the order."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randint(-8, 8, s, generator=g) / 64).bfloat16() for s in SPLIT_SHAPES]


def _split_update(clip: float, shard: tuple[int, int], gradients) -> dict:
    """Three clipped MasterAdamW steps over SPLIT_SHAPES parameters, split as ``shard``;
    ``gradients(step)`` gives each step's gradients (and the loss)."""
    from gpuflow.train.optim.adamw import decay_groups
    from gpuflow.train.optim.master_adamw import MasterAdamW
    from gpuflow.train.sharded import ShardedAverager

    torch.manual_seed(0)
    module = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in SPLIT_SHAPES)
    adamw = torch.optim.AdamW(decay_groups(list(module), 0.1), lr=1e-2)
    opt = MasterAdamW(adamw, shard)
    averager = ShardedAverager(opt) if shard[1] > 1 else None
    update = Update(module, opt, clip, fused_clip=True, averager=averager)
    losses, norms = [], []
    for step in range(3):
        grads, loss = gradients(step)
        for p, grad in zip(module, grads, strict=True):
            p.grad = grad.clone()
        loss = loss.clone()
        norms.append(float(update(loss)))
        losses.append(float(loss))
    opt.gather_state()
    return {
        "weights": [p.detach().clone() for p in module],
        # rank 0 holds the whole state once gathered; every rank only its part before
        "state": [t.clone() for t in opt.whole_state()] if shard[0] == 0 else None,
        "part": opt.master.numel(),
        "losses": losses,
        "norms": norms,
        "bytes_per_step": averager.bytes_per_step if averager else 0,
    }


def _rank_split_update(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:

        def gradients(step):
            return _split_gradients(step, rank), torch.tensor(float(rank + 1))

        results = {clip: _split_update(clip, (rank, 2), gradients) for clip in (0.0, 0.05)}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_an_update_split_over_two_ranks_is_the_whole_update_on_each(tmp_path):
    ranks = _on_two_ranks(_rank_split_update, tmp_path)

    def mean_gradients(step):
        pairs = zip(_split_gradients(step, 0), _split_gradients(step, 1), strict=True)
        return [(a.float() + b.float()).div(2).bfloat16() for a, b in pairs], torch.tensor(1.5)

    for clip in (0.0, 0.05):
        whole = _split_update(clip, (0, 1), mean_gradients)
        for result in (r[clip] for r in ranks):
            assert result["losses"] == [1.5] * 3  # the mean of the ranks' losses
            if clip:  # the norm is summed over the parts: the same up to rounding
                assert result["norms"] == pytest.approx(whole["norms"], rel=1e-5)
                assert min(whole["norms"]) > clip  # the clip acted
            # each rank updated its half of every tensor and gathered the other's
            for ours, theirs in zip(result["weights"], whole["weights"], strict=True):
                if clip:
                    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-3)
                else:
                    assert torch.equal(ours, theirs)
            n = whole["state"][0].numel()
            assert result["part"] * 2 == ranks[0][clip]["state"][0].numel() >= n  # a half
            if result["state"] is None:  # rank 1: its part only, never gathered
                continue
            for ours, theirs in zip(result["state"], whole["state"], strict=True):
                rtol, atol = (1e-5, 1e-7) if clip else (0, 0)
                torch.testing.assert_close(ours[:n], theirs, rtol=rtol, atol=atol)
    numel = sum(torch.Size(s).numel() for s in SPLIT_SHAPES)
    # the padded gradients out, half of the padded bf16 weights, the norm and the loss
    assert 3 * numel <= ranks[0][0.0]["bytes_per_step"] <= 3 * (numel + 8 * 16) + 8


class _Graph:
    """A graph owner as ``CapturedStep`` is one: what ``release`` did, in order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release(self) -> None:
        self.log.append("release")


@pytest.mark.parametrize("leave", ["stop", "abort"])
def test_leaving_the_job_frees_the_graphs_holding_its_collectives_first(monkeypatch, leave):
    """NCCL's communicator waits, however long, for every graph that captured its
    collectives to be freed: the graphs go before the process group does."""
    log: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: log.append("destroy"))
    monkeypatch.setattr(distributed, "_abort_process_group", lambda: log.append("abort"))
    graphs = [_Graph(log), _Graph(log)]
    for graph in graphs:
        distributed.holds_collectives(graph)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        getattr(distributed, leave)()
        assert log == ["release", "release", "destroy" if leave == "stop" else "abort"]
        # Leaving a failed job, torchrun's SIGTERM (sent to every rank once one is gone) must
        # not end the process before it has said why: it is ignored from then on.
        assert signal.getsignal(signal.SIGTERM) == (sigterm if leave == "stop" else signal.SIG_IGN)
        log.clear()
        getattr(distributed, leave)()  # released once: nothing is held any more
        assert log == ["destroy" if leave == "stop" else "abort"]
    finally:
        signal.signal(signal.SIGTERM, sigterm)


@pytest.mark.parametrize("job", [True, False])
@pytest.mark.parametrize("failed", [True, False])
def test_a_rank_failing_in_a_job_keeps_sigterm_ignored_as_it_unwinds(job, failed):
    """A rank that finds another gone inside the step (DDP's all-reduce raising) unwinds out
    of the stop handler's block before it can say so: in a job, SIGTERM is ignored from the
    failure on, not put back to the default that torchrun's SIGTERM would end it by. A run
    that ends well, or one process alone, gets its handlers back."""
    from gpuflow.train.trainer import _StopFlag

    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with suppress(RuntimeError), _StopFlag().installed(job=job):
            assert signal.getsignal(signal.SIGTERM) not in (sigterm, signal.SIG_IGN)
            if failed:
                raise RuntimeError("Connection closed by peer")
        want = signal.SIG_IGN if job and failed else sigterm
        assert signal.getsignal(signal.SIGTERM) == want
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def _rank_left_behind(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ranks = Ranks(rank, 2, rank)
    agree(False, ranks)  # both ranks are there
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank is
    log: list[str] = []
    graph = _Graph(log)  # held weakly by the job: its owner keeps it
    distributed.holds_collectives(graph)
    started = time.monotonic()
    try:
        agree(False, ranks)
        result = "agreed with nobody"
    except RankLost as exc:
        result = str(exc)
    Path(out).write_text(json.dumps({
        "error": result, "seconds": time.monotonic() - started, "log": log,
        "still_in_a_group": dist.is_initialized(),
    }))  # fmt: skip


def test_a_rank_that_finds_another_gone_leaves_the_job_at_once(tmp_path):
    out = tmp_path / "out.json"
    mp.spawn(_rank_left_behind, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    found = json.loads(out.read_text())
    assert found["error"].startswith("another rank of this job stopped or died (")
    assert "--resume" in found["error"] and "\n" not in found["error"]
    assert found["seconds"] < 10  # the closed connection, not a timeout
    assert found["log"] == ["release"] and found["still_in_a_group"] is False


# ---- torchrun -m gpuflow train --------------------------------------------------------------


def _settings(prepared: Path, steps: int) -> list[str]:
    sets = [*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=100"]
    sets += ["train.checkpoint_interval=4", "train.data_path=resident", "train.decay_steps=1000"]
    return ["--device", "cpu", "--steps", str(steps)] + [a for s in sets for a in ("--set", s)]


def _finish(job: subprocess.Popen, cwd: Path) -> str:
    out = torchrun_ended(job, cwd)
    assert job.returncode == 0, out
    return out


def _saved(run: Path) -> dict:
    record = read_record(latest_checkpoint(run))
    return {"step": record["step"], "tokens_seen": record["tokens_seen"], **record["data"]}


def test_torchrun_trains_on_two_ranks_and_resumes_on_one_and_on_two(prepared, workdir):
    run = workdir / "runs" / "dp"
    # A 20 kB budget streams the corpus in chunks: their order carries over between runs.
    budget = ["--set", "data.device_budget_mb=0.02"]
    job = torchrun_cli("--name", "dp", *_settings(prepared, 8), *budget, cwd=workdir)
    out = _finish(job, workdir)
    assert "2 ranks" in out and "MiB per step per rank" in out
    assert out.count("finished at step 8") == 1  # rank 0 speaks for the job
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [2, 4, 6, 8]  # one record per logging step: rank 0 alone writes
    bus = [r for r in read_metrics(run) if "syncs_per_step" in r]  # the largest over ranks
    assert bus and all(r["h2d_bytes_per_step"] == 0 for r in bus)
    report = json.loads((run / "report.json").read_text())
    assert report["tokens_per_s"] > 0 and report["world_size"] == 2
    assert report["final_val_bpb"] > 0  # rank 0, which evaluates, counted the val bytes
    per_rank = B * 2 * 32  # FAST's batch of 8 windows of 32 tokens
    assert report["tokens_per_step"] == 2 * per_rank
    two = _saved(run)
    assert two["world_size"] == 2 and two["chunk_base"] == [0, 0]
    assert two["tokens_seen"] == 8 * 2 * per_rank

    resumed = gpuflow_cli("train", "--name", "dp", "--resume", *_settings(prepared, 12),
                          *budget, cwd=workdir)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout + resumed.stderr
    one = _saved(run)
    # One rank starts fresh rounds at the first chunk the two had not begun.
    assert one["world_size"] == 1 and one["chunk_base"] == [two["next_chunk"], 8]
    assert one["tokens_seen"] == two["tokens_seen"] + 4 * per_rank
    out = _finish(
        torchrun_cli("--name", "dp", "--resume", *_settings(prepared, 16), *budget, cwd=workdir),
        workdir,
    )
    assert "finished at step 16" in out
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]
    assert _saved(run)["chunk_base"] == [one["next_chunk"], 12]


def test_a_rank_killed_mid_run_stops_the_job_and_the_run_resumes(prepared, workdir):
    job = torchrun_cli("--name", "killed", *_settings(prepared, 100000), cwd=workdir)
    checkpoints = workdir / "runs" / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while latest_checkpoint(checkpoints.parent) is None:
        assert time.monotonic() < deadline, (workdir / "torchrun.log").read_text()
        assert job.poll() is None, (workdir / "torchrun.log").read_text()
        time.sleep(0.5)
    workers = torchrun_workers(job)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGKILL)
    started = time.monotonic()
    out = torchrun_ended(job, workdir, timeout=120)  # the job ends: no rank hangs on the dead one
    assert job.returncode != 0, out
    assert time.monotonic() - started < 20, out
    # The survivor says so in one line (found in DDP's all-reduce or at a logging step).
    assert "error: another rank of this job stopped or died" in out, out
    latest = latest_checkpoint(workdir / "runs" / "killed")
    assert latest is not None
    saved = read_record(latest)["step"]
    resumed = gpuflow_cli("train", "--name", "killed", "--resume",
                          *_settings(prepared, saved + 4), cwd=workdir)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"finished at step {saved + 4}" in resumed.stdout


def test_host_sampled_batches_train_data_parallel_under_ddp(prepared, workdir):
    args = _settings(prepared, 4)
    args[args.index("train.data_path=resident")] = "train.data_path=standard"
    _finish(torchrun_cli("--name", "std", *args, cwd=workdir), workdir)
    report = json.loads((workdir / "runs" / "std" / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps_done"] == 4
    # DDP all-reduces the fp32 gradients; the loss is averaged on its own.
    assert report["collective_bytes_per_step_per_rank"] == 4 * (report["parameters"] + 1)
    assert report["exchange"] == "gradients by all-reduce (DDP's buckets)"
    assert report["peak_device_bytes_per_rank"] is None  # the cpu: no device memory


def test_an_interrupted_job_is_told_to_resume_with_its_own_launch():
    from gpuflow.train.trainer import resume_command

    assert resume_command("r", Ranks()) == "gpuflow train --name r --resume"
    four = Ranks(rank=1, world_size=4, local_rank=1, launched=True, local_world_size=4)
    assert (
        resume_command("r", four)
        == "torchrun --nproc_per_node=4 -m gpuflow train --name r --resume"
    )
    two_hosts = Ranks(rank=0, world_size=4, launched=True, local_world_size=2)
    assert resume_command("r", two_hosts).startswith(
        "torchrun --nnodes 2 (and the rest of the launch) --nproc_per_node=2 -m gpuflow train"
    )
