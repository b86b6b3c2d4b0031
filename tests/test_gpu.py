"""The same behaviour on a real accelerator: run with `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.device.linkprobe import probe_link
from gpuflow.interface.sample import SampleConfig, sample
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.run import read_metrics
from gpuflow.train.trainer import Trainer
from gpuflow.transfer.loader import DeviceLoader, upload_tokens
from gpuflow.transfer.mirror import AsyncScalars, HostMirror, host_snapshot
from gpuflow.transfer.packing import pack, unpack
from gpuflow.transfer.pinned import PinnedPool

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


# ---- the transfer layer on a real device ------------------------------------------------------


def _busy(device: Device, ms: float = 30.0) -> None:
    """Keep the current stream busy for about ``ms`` (a spin kernel), so copies queue behind."""
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * 2e6))  # cycles: at least ms at clocks up to 2 GHz


def test_pack_round_trip_on_the_device_with_every_codec(accel):
    rng = np.random.default_rng(0)
    batch = {
        "ids": torch.from_numpy(rng.integers(0, 50000, (8, 129))),
        "big_ids": torch.tensor([-(2**40), 2**40]),
        "image": rng.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8),
        "x": torch.randn(1000),
        "rows": [torch.randn(64) for _ in range(100)],
        "ragged": [[1, 2, 3], [], [70000]],
        "meta": ("name", 3),
    }
    packed = pack(batch, pin_memory=accel.supports_pinned_memory, lossy_float="bf16")
    out = unpack(packed, accel)
    accel.synchronize()
    assert out["ids"].device.type == accel.type and out["ids"].dtype == torch.int64
    assert torch.equal(out["ids"].cpu(), batch["ids"])
    assert torch.equal(out["big_ids"].cpu(), batch["big_ids"])
    assert torch.equal(out["image"].cpu(), torch.from_numpy(batch["image"]))
    assert torch.equal(out["x"].cpu(), batch["x"].bfloat16().float())
    assert all(
        torch.equal(a.cpu(), b.bfloat16().float())
        for a, b in zip(out["rows"], batch["rows"], strict=True)
    )
    assert out["ragged"][2].tolist() == [70000] and out["meta"] == ("name", 3)


def test_pinned_pool_buffers_are_pinned_and_wait_for_their_copy(accel):
    if not accel.supports_pinned_memory:
        pytest.skip("no pinned memory on this backend")
    pool = PinnedPool(accel, max_bytes=64 << 20)
    buf = pool.acquire(32 << 20)
    assert buf.bytes.is_pinned()
    landing = torch.empty(32 << 20, dtype=torch.uint8, device=accel.torch)
    _busy(accel)  # the copy below cannot start for a while
    landing.copy_(buf.bytes, non_blocking=True)
    done = accel.new_event()
    done.record()
    pool.release(buf, after=done)
    other = pool.acquire(32 << 20)  # room under the cap: a different buffer, the first is busy
    assert other.bytes.data_ptr() != buf.bytes.data_ptr() and not done.query()
    third = pool.acquire(32 << 20)  # at the cap: waits for the copy, then reuses its buffer
    assert done.query() and third.bytes.data_ptr() == buf.bytes.data_ptr()
    assert pool.stats.waits == 1
    pool.release(other)
    pool.release(third)
    pool.close()
    assert pool.stats.bytes_reserved == 0


class _PoisoningLoader(DeviceLoader):
    """Before each reuse of a slot, fill it with 0xFF on the copy stream and stall that
    stream, so a consumer that read before the copy finished would see poison."""

    def _issue(self, index, plan, host):
        slot = self._slots[index]
        if slot.buffer is not None:
            with self.device.use_stream(self._copy_stream):
                self._copy_stream.wait_event(slot.consumer_done)
                slot.buffer.fill_(255)
                _busy(self.device, 20.0)
        return super()._issue(index, plan, host)


def test_the_consumer_never_sees_a_slot_before_its_copy_finished(accel):
    n_batches, n = 12, 4 << 20  # 4 Mi float32 per batch
    source = (np.full(n, float(i), dtype=np.float32) for i in range(n_batches))
    ok = torch.ones((), dtype=torch.bool, device=accel.torch)
    with _PoisoningLoader(source, accel, depth=2) as loader:
        for i, batch in enumerate(loader):
            ok &= (batch == float(i)).all()  # every element, on the consumer's stream
    assert bool(ok.item())
    assert loader.stats.batches == n_batches


def test_loader_memory_is_flat_and_copies_overlap_compute(accel):
    batch = torch.randn(1 << 20)  # 4 MB
    reserved = []
    with DeviceLoader(itertools.repeat(batch, 2000), accel) as loader:
        for i, on_device in enumerate(loader, start=1):
            _busy(accel, 1.0)  # compute that the next copy can hide behind
            on_device.sum()
            if i in (100, 2000):
                accel.synchronize()
                reserved.append(
                    (loader._pool.stats.bytes_reserved, torch.cuda.memory_reserved(accel.torch))
                )
    assert reserved[0] == reserved[1]
    stats = loader.stats
    assert stats.overlap_ms > 0.8 * stats.transfer_ms  # the copies hid behind the compute


def test_trainer_streams_uint16_tokens_through_the_loader(accel, prepared, workdir):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=8"])
    trainer = Trainer(config, workdir / "runs" / "l", accel)
    result = trainer.run()
    assert result.last_step == 8


def test_host_mirror_partial_reads_and_async_refresh(accel):
    table = torch.randn(4096, 1024, device=accel.torch)  # 16 MB
    mirror = HostMirror(table)
    assert mirror[7, 5] == pytest.approx(table[7, 5].item())
    assert mirror.stats.bytes_fetched == 4
    _busy(accel, 50.0)
    table.mul_(2.0)  # queued behind the busy kernel
    started = time.perf_counter()
    mirror.refresh_async()
    assert time.perf_counter() - started < 0.02  # queued, not waited for
    np.testing.assert_array_equal(mirror.numpy(), table.cpu().numpy())


def test_host_mirror_needs_mark_dirty_after_a_graph_replay(accel):
    if accel.type != "cuda":
        pytest.skip("CUDA graphs")
    state = torch.zeros(16, device=accel.torch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        state.add_(1)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.add_(1)
    mirror = HostMirror(state)
    before = mirror.numpy()[0]
    graph.replay()
    assert mirror.is_fresh()  # the replay did not bump the version: the mirror cannot know
    mirror.mark_dirty()
    assert mirror.numpy()[0] == before + 1


def test_a_pinned_source_is_copied_directly_without_staging(accel):
    if not accel.supports_pinned_memory:
        pytest.skip("no pinned memory on this backend")

    def source():
        for i in range(20):  # a fresh pinned tensor per batch, as DataLoader(pin_memory) gives
            yield {"x": torch.full((1 << 20,), float(i)).pin_memory(), "i": i}

    ok = torch.ones((), dtype=torch.bool, device=accel.torch)
    with DeviceLoader(source(), accel, depth=2) as loader:
        for batch in loader:
            _busy(accel, 1.0)
            ok &= (batch["x"] == float(batch["i"])).all()
    assert bool(ok.item())
    stats = loader.stats
    assert stats.copies == 20 and stats.bytes_moved == 20 * (4 << 20)  # one copy each, direct
    assert loader._pool.stats.misses == 0  # nothing was staged


# ---- the transfer ledger against the device's own record ------------------------------------


def test_ledger_agrees_with_the_profilers_memcpy_events(accel, tmp_path):
    from gpuflow.accounting.crosscheck import ProfiledLedger

    pinned = torch.randn(1 << 18).pin_memory()  # 1 MiB
    pageable = torch.randn(1024)  # 4 KiB
    on_device = torch.randn(1 << 14, device=accel.torch)  # 64 KiB
    landing = torch.empty(1 << 14).pin_memory()
    accel.synchronize()
    with ProfiledLedger(tmp_path / "trace.json", accel) as run:
        pinned.to(accel.torch, non_blocking=True)
        pageable.to(accel.torch)  # blocking: a sync
        landing.copy_(on_device, non_blocking=True)
        for i in range(3):
            on_device[i].item()  # 4 bytes down and a sync, each
    rows = {row.kind: row for row in run.comparison()}
    assert (rows["h2d"].ledger_copies, rows["h2d"].ledger_bytes) == (2, (1 << 20) + 4096)
    assert (rows["d2h"].ledger_copies, rows["d2h"].ledger_bytes) == (4, (1 << 16) + 12)
    assert rows["h2d"].agrees and rows["d2h"].agrees, rows
    assert run.ledger.summary().totals.syncs == 4
    assert (tmp_path / "trace.json").stat().st_size > 0


def _streaming_trainer(accel, prepared, workdir):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=12"])
    trainer = Trainer(config, workdir / "runs" / "budget", accel)
    trainer.build(resume=False)
    return trainer, config.train.batch_size * (config.model.max_len + 1)


def test_streamed_step_budget_holds_on_the_device(accel, prepared, workdir):
    from gpuflow.accounting.budgets import budget

    trainer, ids = _streaming_trainer(accel, prepared, workdir)
    with DeviceLoader(trainer.token_batches(), accel) as loader:
        batches = iter(loader)
        for step in range(3):  # warm-up: the allocator fills its cache
            trainer.train_step_on_tokens(step, next(batches))
        accel.synchronize()
        for step in range(3, 8):
            limits = budget(
                h2d_bytes=(2 * ids + 15) // 16 * 16, d2h_bytes=0, syncs=0, device_allocs=0
            )
            with limits:
                trainer.train_step_on_tokens(step, next(batches))
            totals = limits.ledger.summary().totals
            assert totals.h2d_bytes == 2 * ids and totals.h2d_copies == 1


def test_a_stray_item_in_a_training_step_is_caught_at_its_line(accel, prepared, workdir):
    from gpuflow.accounting.budgets import BudgetExceeded, budget

    trainer, _ = _streaming_trainer(accel, prepared, workdir)

    def leaky_step(step, batch):
        loss, grad_norm = trainer.train_step_on_tokens(step, batch)
        print(f"loss {loss.item():.3f}")  # the stray read
        return loss, grad_norm

    with DeviceLoader(trainer.token_batches(), accel) as loader:
        batches = iter(loader)
        trainer.train_step_on_tokens(0, next(batches))
        with pytest.raises(BudgetExceeded) as caught, budget(syncs=0):
            leaky_step(1, next(batches))
    line = next(
        n
        for n, text in enumerate(Path(__file__).read_text().splitlines(), start=1)
        if "# the stray read" in text and "text" not in text
    )
    assert f"test_gpu.py:{line}" in str(caught.value)
    assert caught.value.over == {"syncs": (1, 0)}


def test_profile_command_writes_a_trace_and_its_copies_agree(accel, prepared, workdir):
    import json

    from gpuflow.interface.profile import profile_training

    config = resolve_config(
        "tiny", None, [*FAST, f"data.dir={prepared}", "train.data_path=streamed"]
    )
    out = workdir / "profile"
    result = profile_training(config, out, accel, steps=4, warmup=2)
    for name in ("trace.json", "timeline.png", "profile.json"):
        assert (out / name).stat().st_size > 0
    rows = {row["kind"]: row for row in result["crosscheck"]}
    assert rows["h2d"]["agrees"] and rows["h2d"]["ledger_copies"] == 4, rows
    m = result["metrics"]
    assert m["syncs_per_batch"] == 0 and m["device_allocs_per_batch"] == 0
    assert 0 < m["link_utilisation"] <= 1.2 and 0 <= m["transfer_overhead"] <= 1
    assert json.loads((out / "profile.json").read_text())["steps"] == 4


def test_every_kind_of_host_wait_is_counted_on_the_device(accel):
    from gpuflow.accounting.ledger import TransferLedger

    x = torch.arange(8, device=accel.torch, dtype=torch.float32)
    stream, event = torch.cuda.Stream(), torch.cuda.Event()
    with TransferLedger(accel) as ledger:
        x.tolist()  # wait-tolist
        x.cpu()  # wait-cpu
        x.nonzero()
        x[x > 3]
        event.record()
        event.synchronize()
        stream.synchronize()
        torch.cuda.synchronize()
        accel.synchronize()
        x.sum()  # compute: nothing counted
    syncs = [e for e in ledger.events if e.kind == "sync"]
    lines = Path(__file__).read_text().splitlines()

    def at(marker: str) -> list[str]:
        line = next(n for n, t in enumerate(lines, 1) if marker in t and "at(" not in t)
        return [e.op for e in syncs if e.location.endswith(f":{line}")]

    assert at("# wait-tolist") and at("# wait-cpu") == ["blocking d2h to"]
    assert [e.op for e in syncs][-6:] == [
        "nonzero",
        "boolean-mask indexing",
        "Event.synchronize",
        "Stream.synchronize",
        "torch.cuda.synchronize",
        "Device.synchronize",
    ]
    downloads = [e for e in ledger.events if e.kind == "d2h"]
    assert sum(e.nbytes for e in downloads) >= 2 * 32  # tolist and cpu: 32 bytes each


# ---- the resident corpus and the captured step ------------------------------------------------


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_captured_and_eager_steps_give_the_same_losses(accel, prepared, workdir):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    runs = {}
    for mode in ("resident", "resident-graph"):
        config = resolve_config("tiny", None, [*sets, f"train.data_path={mode}"])
        trainer = Trainer(config, workdir / "runs" / mode, accel)
        trainer.run()
        runs[mode] = trainer
    if accel.type == "cuda":  # the captured step took bf16 weights over fp32 masters
        from gpuflow.train.master_adamw import MasterAdamW

        assert isinstance(runs["resident-graph"].optimizer, MasterAdamW)
        assert all(p.dtype == torch.bfloat16 for p in runs["resident-graph"].model.parameters())
    eager, captured = (_losses(workdir / "runs" / m) for m in ("resident", "resident-graph"))
    assert len(eager) == len(captured) == 20
    assert captured == pytest.approx(eager, rel=2e-2)  # bf16 autocast: same kernels, same data
    # The schedule kept moving inside the graph: the device learning rate is the last step's.
    from gpuflow.train.optim import lr_at

    graph_lr = runs["resident-graph"]._lr.item()
    tc = runs["resident-graph"].config.train
    assert graph_lr == pytest.approx(lr_at(19, tc), rel=1e-5)
    assert graph_lr != pytest.approx(lr_at(3, tc), rel=1e-3)  # the lr at capture time


def test_resident_graph_steps_move_nothing_and_never_wait(accel, prepared, workdir):
    from gpuflow.accounting.budgets import budget
    from gpuflow.train.datapath import open_batches
    from gpuflow.transfer.mirror import AsyncScalars

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
    scalars = AsyncScalars(Trainer.SCALARS, accel)
    with open_batches("resident-graph", trainer, 0, 40) as batches:
        step_fn = trainer.stepper("resident-graph", batches, scalars)
        for step in range(6):  # warm-up and capture
            step_fn(step)
        for step in range(6, 12):
            with budget(h2d_bytes=0, d2h_bytes=0, syncs=0, device_allocs=0):
                step_fn(step)


def test_a_small_budget_streams_chunks_across_boundaries(accel, prepared, workdir):
    from gpuflow.data.resident import ResidentTokens
    from gpuflow.data.tokens import TokenFolder

    # 10,240 bytes: two buffers of 2,560 uint16 tokens, 10 steps of 8 x 32 tokens each.
    budget_mb = 0.01024
    shards = TokenFolder.open(prepared).train
    tokens = ResidentTokens(shards, accel, 8, 32, budget_bytes=int(budget_mb * 1e6))
    assert (tokens.chunk_tokens, tokens.steps_per_chunk) == (2560, 10) and tokens.n_chunks > 6
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
        assert val[-1] < val[0] - 0.3, mode


def test_a_compiled_captured_step_learns_like_the_eager_one(accel, prepared, workdir):
    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    losses = {}
    runs = {
        "eager": ["train.data_path=resident"],
        "compiled": ["train.data_path=resident-graph", "train.compile=true"],
    }
    for name, extra in runs.items():
        config = resolve_config("tiny", None, [*sets, *extra])
        trainer = Trainer(config, workdir / "runs" / name, accel)
        trainer.run()
        assert (trainer.forward is not trainer.model) == (name == "compiled")
        losses[name] = _losses(workdir / "runs" / name)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=5e-2)
    # The compiled schedule inside the graph left the last step's learning rate.
    from gpuflow.train.optim import lr_at

    assert trainer._lr.item() == pytest.approx(lr_at(19, trainer.config.train), rel=1e-5)


def test_the_naive_path_downloads_the_tables_for_every_sequence(accel, prepared, workdir):
    from gpuflow.accounting.ledger import TransferLedger
    from gpuflow.train.datapath import open_batches
    from gpuflow.transfer.mirror import AsyncScalars

    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=4"])
    trainer = Trainer(config, workdir / "runs" / "naive", accel)
    trainer.build(resume=False)
    scalars = AsyncScalars(Trainer.SCALARS, accel)
    with open_batches("naive", trainer, 0, 4) as batches:
        step_fn = trainer.stepper("naive", batches, scalars)
        step_fn(0)
        with TransferLedger(accel) as ledger:
            step_fn(1)
    totals = ledger.summary().totals
    B, T, C = 8, 32, 64
    tables = (512 + 32) * C * 4  # both embedding tables in fp32, every sequence
    assert totals.d2h_bytes >= B * tables
    assert totals.h2d_bytes >= B * T * C * 4  # the embeddings go up, one sequence at a time
    assert totals.syncs >= 3 * B  # two downloads and a loss read per sequence, at least


def test_profile_of_the_captured_step_shows_no_transfers(accel, prepared, workdir):
    from gpuflow.interface.profile import profile_training

    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}"])
    result = profile_training(config, workdir / "profile-graph", accel, steps=4, warmup=4)
    assert result["data_path"] == "resident-graph"
    rows = {row["kind"]: row for row in result["crosscheck"]}
    assert rows["h2d"]["ledger_copies"] == rows["h2d"]["profiler_copies"] == 0  # uploaded before
    m = result["metrics"]
    assert m["h2d_bytes_per_batch"] == 0 and m["syncs_per_batch"] == 0 and m["step_ms"] > 0


@pytest.mark.parametrize("vocab", [1000, 16000, 50304])  # one pass, one pass, two passes
def test_the_fused_head_kernel_matches_fp32_cross_entropy(accel, vocab):
    import torch.nn.functional as F

    from gpuflow.model.head import linear_cross_entropy

    g = torch.Generator(device=accel.torch).manual_seed(0)
    hidden = torch.randn(512, 64, device=accel.torch, generator=g)
    weight = torch.randn(vocab, 64, device=accel.torch, generator=g) * 0.3
    targets = torch.randint(0, vocab, (512,), device=accel.torch, generator=g)

    def run(fn, autocast):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(accel.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w, targets)
        (2 * loss).backward()
        return loss.detach(), h.grad, w.grad

    reference = run(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), autocast=False)
    torch._dynamo.reset()  # compiled for this vocab alone, as the trainer compiles per model
    for fn in (linear_cross_entropy, torch.compile(linear_cross_entropy)):
        got = run(fn, autocast=True)
        for a, b in zip(got, reference, strict=True):
            assert a.dtype == b.dtype == torch.float32
            # bf16 products against fp32 ones: about 3 significant digits
            assert (a - b).abs().max() <= 1e-2 * b.abs().max(), vocab


def test_clipping_inside_fused_adamw_matches_clip_grad_norm(accel, prepared, workdir):
    from gpuflow.train.optim import build_optimizer

    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.grad_clip=0.05"])
    trainer = Trainer(config, workdir / "runs" / "clip", accel)
    trainer.build(resume=False)
    assert trainer.optimizer.defaults["fused"]
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batch = trainer.val_batches[0]

    def one_step(update) -> dict[str, torch.Tensor]:
        """From the same weights and batch, fresh AdamW state, one update."""
        trainer.model.load_state_dict(start)
        trainer.model.zero_grad(set_to_none=True)
        with accel.autocast():
            trainer.model(batch[:, :-1], batch[:, 1:]).backward()
        trainer.optimizer = build_optimizer(trainer.model, config.train, accel)
        for group in trainer.optimizer.param_groups:
            group["eps"] = 1.0  # Adam's first step is lr * g / (|g| + eps): scale-sensitive
        update()
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    norms = []
    ours = one_step(lambda: norms.append(trainer._update()))  # factor passed as grad_scale

    def reference() -> None:
        norms.append(torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 0.05))
        trainer.optimizer.step()

    clipped = one_step(reference)
    unclipped = one_step(lambda: trainer.optimizer.step())
    assert norms[0].item() == pytest.approx(norms[1].item(), rel=1e-4)
    assert norms[0].item() > 0.05 * 2  # clipping was active
    differs = 0
    for name, value in clipped.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-7)
        differs += int(not torch.allclose(unclipped[name], value, rtol=1e-3, atol=1e-6))
    assert differs > 0


def test_compiled_attention_uses_flex_and_matches_sdpa(accel):
    from torch._dynamo.testing import CompileCounterWithBackend

    from gpuflow.model.gpt import CausalSelfAttention, ModelConfig

    if accel.type != "cuda":
        pytest.skip("FlexAttention is taken on CUDA only")
    config = ModelConfig(vocab_size=100, n_layer=1, n_head=6, d_model=384, max_len=128)
    torch.manual_seed(0)
    attention = CausalSelfAttention(config).to(accel.torch)
    x = torch.randn(4, 128, 384, device=accel.torch)

    def run(fn):
        attention.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with accel.autocast(cache=False):
            y = fn(xi)
        (y.float() ** 2).mean().backward()
        return y.float(), xi.grad, attention.qkv.weight.grad

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = run(torch.compile(attention, backend=counter))
    graph = "\n".join(str(g.graph) for g in counter.graphs)
    assert "flex_attention" in graph and "scaled_dot_product" not in graph
    eager = run(attention)
    for a, b in zip(compiled, eager, strict=True):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_the_master_adamw_kernel_matches_its_reference(accel, monkeypatch):
    from gpuflow.train.master_adamw import MasterAdamW
    from gpuflow.train.optim import decay_groups

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


# ---- snapshots and checkpoints on the device ---------------------------------------------------


def test_a_snapshot_is_one_copy_without_a_host_wait(accel):
    from gpuflow.accounting.ledger import TransferLedger
    from gpuflow.transfer.snapshot import StateSnapshot

    state = {
        "model": {
            "w": torch.randn(1024, 1024, device=accel.torch),
            "h": torch.randn(333, device=accel.torch).to(torch.bfloat16),
        },
        "optimizer": {
            "m": torch.randn(4096, device=accel.torch),
            "step": torch.tensor(3.0, device=accel.torch),
        },
    }
    expected = {g: {k: v.cpu() for k, v in t.items()} for g, t in state.items()}
    snapshots = StateSnapshot(accel)
    for round_ in range(3):  # later captures reuse both buffers
        _busy(accel, 50)  # the device is still busy when the snapshot is asked for
        started = time.perf_counter()
        snap = snapshots.capture(state)
        queued_s = time.perf_counter() - started
        state["model"]["w"].add_(1.0)  # the next step's update: queued after, never seen
        if round_ > 0:  # (the first pins its host buffer, which may wait for the device)
            assert queued_s < 0.025, round_  # returned while the device was still busy
        snap.wait()
        for group, tensors in expected.items():
            for name, tensor in tensors.items():
                assert torch.equal(snap.tensors(group)[name], tensor), (round_, name)
        snap.release()
        expected["model"]["w"] += 1.0
    with TransferLedger(accel) as ledger:
        snapshots.capture(state).release()
    totals = ledger.summary().totals
    assert totals.syncs == 0 and totals.d2h_copies == 1, totals
    assert totals.allocator_requests == 0 and totals.device_allocs == 0, totals


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
