"""Training on a real accelerator: whole runs, each data path's step, the captured step and
the resident corpus, the optimizers' kernels, and checkpoints of a run that keeps training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.schedule import lr_at
from gpuflow.train.step import GraphStep, TrainStep
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

pytestmark = pytest.mark.gpu


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def _run_keeping_step(trainer: Trainer) -> TrainStep:
    """``trainer.run()``, returning the step it ran: its device state (the captured step's
    learning rate) outlives the run, and the run's loop has no other handle on it."""
    opened, kept = trainer.open_step, []

    @contextmanager
    def open_step(*args, **kwargs) -> Iterator[TrainStep]:
        with opened(*args, **kwargs) as train_step:
            kept.append(train_step)
            yield train_step

    trainer.open_step = open_step
    trainer.run()
    return kept[0]


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
    from gpuflow.train.optim.master_adamw import MasterAdamW

    if accel.type != "cuda":
        pytest.skip("fused AdamW is the CUDA path")
    sets = [*FAST, f"data.dir={prepared}", "train.steps=2"]
    config = resolve_config("tiny", None, [*sets, "train.data_path=resident"])
    trainer = Trainer(config, workdir / "runs" / "f", accel)
    trainer.build(resume=False)
    assert isinstance(trainer.setup.optimizer, torch.optim.AdamW)
    assert trainer.setup.optimizer.defaults["fused"]
    # What a real step computes in: a linear layer's output under the step's autocast.
    linear = next(m for m in trainer.setup.model.modules() if isinstance(m, torch.nn.Linear))
    dtypes = []
    hook = linear.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    with trainer.open_step(0, 2) as train_step:
        train_step(0)
    hook.remove()
    assert dtypes == [torch.bfloat16]
    # The default (captured) path keeps bf16 weights over fp32 masters.
    config = resolve_config("tiny", None, sets)
    trainer = Trainer(config, workdir / "runs" / "f2", accel)
    trainer.build(resume=False)
    assert isinstance(trainer.setup.optimizer, MasterAdamW)
    assert all(p.dtype == torch.bfloat16 for p in trainer.setup.model.parameters())


def test_trainer_streams_uint16_tokens_through_the_loader(accel, prepared, workdir):
    config = resolve_config(
        "tiny",
        None,
        [
            *FAST,
            f"data.dir={prepared}",
            "train.steps=8",
            "train.log_interval=4",  # > 1: each interval's last step is sampled for bus figures
            "train.data_path=streamed",
        ],
    )
    result = Trainer(config, workdir / "runs" / "l", accel).run()
    assert result.last_step == 8
    # Each step took one batch of uint16 ids (B x (T+1) x 2 bytes, 16-byte aligned).
    ids_bytes = (2 * config.train.batch_size * (config.model.max_len + 1) + 15) // 16 * 16
    logged = [r for r in read_metrics(result.run_dir) if "loss" in r]
    assert [r["step"] for r in logged] == [4, 8]
    assert all(r["h2d_bytes_per_step"] == ids_bytes for r in logged), logged
    state = json.loads((ckpt.latest_checkpoint(result.run_dir) / ckpt.STATE_FILE).read_text())
    assert state["data"]["path"] == "streamed"


# ---- the resident corpus and the captured step ------------------------------------------------


def test_captured_and_eager_steps_give_the_same_losses(accel, prepared, workdir):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    runs, steps = {}, {}
    for mode in ("resident", "resident-graph"):
        config = resolve_config("tiny", None, [*sets, f"train.data_path={mode}"])
        trainer = Trainer(config, workdir / "runs" / mode, accel)
        steps[mode] = _run_keeping_step(trainer)
        runs[mode] = trainer
    eager, captured = (_losses(workdir / "runs" / m) for m in ("resident", "resident-graph"))
    assert len(eager) == len(captured) == 20
    assert captured == pytest.approx(eager, rel=2e-2)  # bf16 autocast: same kernels, same data
    if accel.type == "cuda":  # the captured step took bf16 weights over fp32 masters
        from gpuflow.train.optim.master_adamw import MasterAdamW

        graph_run = runs["resident-graph"].setup
        assert isinstance(graph_run.optimizer, MasterAdamW)
        assert all(p.dtype == torch.bfloat16 for p in graph_run.model.parameters())
        # The schedule kept moving inside the graph: the device learning rate is the last
        # step's. (Elsewhere resident-graph runs as resident: there is no graph.)
        graph_step = steps["resident-graph"]
        assert isinstance(graph_step, GraphStep)
        graph_lr = graph_step.lr.item()
        tc = runs["resident-graph"].config.train
        assert graph_lr == pytest.approx(lr_at(19, tc), rel=1e-5)
        assert graph_lr != pytest.approx(lr_at(3, tc), rel=1e-3)  # the lr at capture time


def test_resident_graph_steps_move_nothing_and_never_wait(accel, prepared, workdir):
    from gpuflow.accounting.budgets import budget

    config = resolve_config(
        "tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=40", "train.log_interval=5"]
    )
    trainer = Trainer(config, workdir / "runs" / "g", accel)
    result = trainer.run()
    logged = [r for r in read_metrics(result.run_dir) if "loss" in r]
    assert len(logged) == 8 and all(r["h2d_bytes_per_step"] == 0 for r in logged)
    # After the first interval (warm-up, capture): no cudaMalloc. The only wait allowed is
    # the logging step's, when the host has run two intervals ahead of the device.
    assert all(r["device_allocs_per_step"] == 0 for r in logged[1:])
    assert all(r["syncs_per_step"] <= 1 / 5 for r in logged)
    # Each interval is timed on the device: a host queueing replays ahead of it does not
    # show as a faster interval.
    rates = [r["tokens_per_s"] for r in logged[1:]]
    assert max(rates) < 2 * sorted(rates)[len(rates) // 2]

    trainer = Trainer(config, workdir / "runs" / "g2", accel)
    trainer.build(resume=False)
    with trainer.open_step(0, 40) as train_step:
        for step in range(6):  # warm-up and capture
            train_step(step)
        if accel.type == "cuda":  # the steps below are replays of the graph
            assert isinstance(train_step, GraphStep) and train_step.captured.graph is not None
        for step in range(6, 12):
            with budget(h2d_bytes=0, d2h_bytes=0, syncs=0, device_allocs=0):
                train_step(step)


def test_a_small_budget_streams_chunks_across_boundaries(accel, prepared, workdir):
    from gpuflow.data.resident.tokens import ResidentTokens
    from gpuflow.data.tokens import TokenFolder

    # 10,240 bytes: two buffers of at most 2,560 uint16 tokens (the corpus in equal chunks),
    # 9 or 10 steps of 8 x 32 tokens each.
    budget_mb = 0.01024
    shards = TokenFolder.open(prepared).train
    tokens = ResidentTokens(shards, accel, 8, 32, budget_bytes=int(budget_mb * 1e6))
    assert 2560 * 0.9 < tokens.chunk_tokens <= 2560 and tokens.n_chunks > 6
    assert tokens.steps_per_chunk == tokens.chunk_tokens // (8 * 32)
    for mode in ("resident", "resident-graph"):
        config = resolve_config(
            "tiny",
            None,
            [
                *FAST,
                f"data.dir={prepared}",
                "train.steps=60",
                "train.eval_interval=60",
                f"train.data_path={mode}",
                f"data.device_budget_mb={budget_mb}",
            ],
        )
        result = Trainer(config, workdir / "runs" / mode, accel).run()  # six chunk switches
        val = [r["val_loss"] for r in read_metrics(result.run_dir) if "val_loss" in r]
        assert val[-1] < val[0] - 0.3, (mode, val)


# T 128 takes FlexAttention with the model's own kernel blocks, T 32 inductor's.
@pytest.mark.parametrize("max_len", [32, 128])
def test_a_compiled_captured_step_learns_like_the_eager_one(accel, prepared, workdir, max_len):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    sets.append(f"model.max_len={max_len}")
    losses = {}
    runs = {
        "eager": ["train.data_path=resident"],
        "compiled": ["train.data_path=resident-graph", "train.compile=true"],
    }
    for name, extra in runs.items():
        config = resolve_config("tiny", None, [*sets, *extra])
        trainer = Trainer(config, workdir / "runs" / name, accel)
        train_step = _run_keeping_step(trainer)
        assert (trainer.setup.forward is not trainer.setup.model) == (name == "compiled")
        losses[name] = _losses(workdir / "runs" / name)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=5e-2)
    # The compiled schedule inside the graph left the last step's learning rate.
    assert isinstance(train_step, GraphStep)
    assert train_step.lr.item() == pytest.approx(lr_at(19, trainer.config.train), rel=1e-5)


def test_the_naive_path_downloads_the_tables_for_every_sequence(accel, prepared, workdir):
    from gpuflow.accounting.ledger import TransferLedger
    from gpuflow.bench.baselines.naive import NaiveBatches  # (registering the naive path)

    config = resolve_config(
        "tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=4", "train.data_path=naive"]
    )
    trainer = Trainer(config, workdir / "runs" / "naive", accel)
    trainer.build(resume=False)
    with trainer.open_step(0, 4) as train_step:
        assert isinstance(train_step.batches, NaiveBatches)
        train_step(0)
        with TransferLedger(accel) as ledger:
            train_step(1)
    totals = ledger.summary().totals
    B, T, C = 8, 32, 64
    tables = (512 + 32) * C * 4  # both embedding tables in fp32, every sequence
    assert totals.d2h_bytes >= B * tables
    assert totals.h2d_bytes >= B * T * C * 4  # the embeddings go up, one sequence at a time
    assert totals.syncs >= 3 * B  # two downloads and a loss read per sequence, at least


# ---- the optimizers' kernels ------------------------------------------------------------------


def test_clipping_inside_fused_adamw_matches_clip_grad_norm(accel, prepared, workdir):
    from gpuflow.train.optim.adamw import build_optimizer
    from gpuflow.train.step import Update

    # The eager resident path: fp32 weights under torch's fused AdamW (the captured path's
    # MasterAdamW has its own kernel test below).
    config = resolve_config(
        "tiny",
        None,
        [*FAST, f"data.dir={prepared}", "train.grad_clip=0.05", "train.data_path=resident"],
    )
    trainer = Trainer(config, workdir / "runs" / "clip", accel)
    trainer.build(resume=False)
    model, optimizer = trainer.setup.model, trainer.setup.optimizer
    assert optimizer.defaults["fused"]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batch = trainer.setup.val_batches[0]

    def one_step(update) -> dict[str, torch.Tensor]:
        """From the same weights and batch, fresh AdamW state, one update."""
        nonlocal optimizer
        model.load_state_dict(start)
        model.zero_grad(set_to_none=True)
        with accel.autocast():
            model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer = build_optimizer(model, config.train, accel)
        for group in optimizer.param_groups:
            group["eps"] = 1.0  # Adam's first step is lr * g / (|g| + eps): scale-sensitive
        update()
        return {k: v.clone() for k, v in model.state_dict().items()}

    norms = []

    def fused() -> None:  # the factor passed as grad_scale, as the training step does
        norms.append(Update(model, optimizer, 0.05, fused_clip=True)())

    ours = one_step(fused)

    def reference() -> None:
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        optimizer.step()

    clipped = one_step(reference)
    unclipped = one_step(lambda: optimizer.step())
    assert norms[0].item() == pytest.approx(norms[1].item(), rel=1e-4)
    assert norms[0].item() > 0.05 * 2  # clipping was active
    differs = 0
    for name, value in clipped.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-7)
        differs += int(not torch.allclose(unclipped[name], value, rtol=1e-3, atol=1e-6))
    assert differs > 0


def test_the_master_adamw_kernel_matches_its_reference(accel, monkeypatch):
    from gpuflow.train.optim.adamw import decay_groups
    from gpuflow.train.optim.master_adamw import MasterAdamW

    if not MasterAdamW.runs_on(accel.torch):
        pytest.skip("the one-kernel update runs on CUDA with triton")
    g = torch.Generator().manual_seed(0)
    # 4096-element blocks over sizes around them; (7, 9) makes the unaligned kernel run
    for shapes in ([(300, 64), (64,), (5000,), (7, 9)], [(4096, 3), (64,), (8200,)]):
        start = [torch.randn(s, generator=g) for s in shapes]
        grads = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(3)]
        opts, owned = [], []
        for _ in range(2):
            params = [torch.nn.Parameter(x.to(accel.torch)) for x in start]
            # torch's betas (0.9, 0.999): 1 - 0.999^t is where precision is hardest to keep
            opts.append(MasterAdamW(torch.optim.AdamW(decay_groups(params, 0.1), lr=1e-2)))
            owned.append(params)
        kernel, reference = opts
        for step_grads in grads:
            for opt, params in zip(opts, owned, strict=True):
                for p, grad in zip(params, step_grads, strict=True):
                    p.grad = grad.to(accel.torch)
                opt.grad_scale = torch.tensor(1.7, device=accel.torch)
            kernel.step()
            with monkeypatch.context() as patch:
                patch.setattr(MasterAdamW, "runs_on", staticmethod(lambda device: False))
                reference.step()
        torch.testing.assert_close(kernel.master, reference.master, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kernel.exp_avg_sq, reference.exp_avg_sq, rtol=1e-5, atol=1e-9)
        assert torch.equal(kernel.weights, kernel.master.bfloat16())


def test_the_master_adamw_kernel_split_in_three_updates_what_it_updates_whole(accel):
    """Parts cut across tensors and across 4096-element blocks: each part's kernel updates
    exactly its elements, as the whole kernel does."""
    from gpuflow.train.optim.adamw import decay_groups
    from gpuflow.train.optim.master_adamw import MasterAdamW

    if not MasterAdamW.runs_on(accel.torch):
        pytest.skip("the one-kernel update runs on CUDA with triton")
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 64), (64,), (5000,), (7, 9), (8200,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(3)]
    opts = []
    for shard in [(0, 1), (0, 3), (1, 3), (2, 3)]:
        params = [torch.nn.Parameter(x.to(accel.torch)) for x in start]
        opt = MasterAdamW(torch.optim.AdamW(decay_groups(params, 0.1), lr=1e-2), shard)
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.to(accel.torch)
            opt.grad_scale = torch.tensor(1.7, device=accel.torch)
            opt.step()
        opts.append(opt)
    whole, parts = opts[0], opts[1:]
    n = whole.master.numel()
    for name in ("master", "exp_avg", "exp_avg_sq"):  # each part holds its own elements alone
        held = [getattr(p, name) for p in parts]
        assert [t.numel() for t in held] == [hi - lo for lo, hi in (p.shard_range for p in parts)]
        assert torch.equal(torch.cat(held)[:n], getattr(whole, name)), name
    joined = torch.cat([p.weights[slice(*p.shard_range)] for p in parts])[:n]
    assert torch.equal(joined, whole.weights)
    params = [torch.nn.Parameter(x.to(accel.torch)) for x in start]
    initial = MasterAdamW(torch.optim.AdamW(decay_groups(params, 0.1), lr=1e-2)).weights
    for part in parts:  # outside its part, no weight moved
        lo, hi = part.shard_range
        outside = torch.ones(n, dtype=torch.bool, device=accel.torch)
        outside[lo:hi] = False
        assert torch.equal(part.weights[:n][outside], initial[outside])


# ---- checkpoints ------------------------------------------------------------------------------


def test_checkpoints_of_a_captured_run_are_written_while_it_trains(accel, prepared, workdir):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=30", "train.log_interval=5"]
    config = resolve_config("tiny", None, [*sets, "train.checkpoint_interval=10"])
    result = Trainer(config, workdir / "runs" / "ck", accel).run()
    names = [p.name for p in ckpt.list_checkpoints(result.run_dir)]
    assert names == ["step_000010", "step_000020", "step_000030"]
    logged = [r for r in read_metrics(result.run_dir) if "loss" in r]
    # Checkpoint steps cost no wait and no allocation in the steps after them.
    assert all(r["syncs_per_step"] <= 1 / 5 for r in logged)
    assert all(r["device_allocs_per_step"] == 0 for r in logged[2:])
    # The files hold the fp32 masters of the captured step, and resume on the cpu.
    data = ckpt.read_checkpoint(ckpt.latest_checkpoint(result.run_dir))
    assert all(t.dtype == torch.float32 for t in data.weights.values())
    more = resolve_config("tiny", None, [*sets, "train.steps=32"])
    resumed = Trainer(more, result.run_dir, Device("cpu")).run(resume=True)
    assert (resumed.start_step, resumed.last_step) == (30, 32)


def test_fp8_products_train_like_bf16_in_the_captured_step(accel, prepared, workdir):
    if accel.type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need FP8 tensor cores")
    from gpuflow.model.fp8 import FP8Linear

    sets = [*FAST, f"data.dir={prepared}", "train.steps=40", "train.eval_interval=40",
            "train.log_interval=1", "train.compile=true"]  # fmt: skip
    losses, val = {}, {}
    for fp8 in (False, True):
        run_dir = workdir / "runs" / f"fp8-{fp8}"
        config = resolve_config("tiny", None, [*sets, f"train.fp8={str(fp8).lower()}"])
        trainer = Trainer(config, run_dir, accel)
        assert isinstance(_run_keeping_step(trainer), GraphStep)
        kinds = {type(m) for m in trainer.setup.model.blocks.modules()}
        assert (FP8Linear in kinds) == fp8
        losses[fp8] = _losses(run_dir)
        val[fp8] = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    assert losses[True][-1] < losses[True][0] - 0.5  # it learns
    assert losses[True] == pytest.approx(losses[False], rel=3e-2)
    assert val[True][-1] == pytest.approx(val[False][-1], rel=2e-2)
