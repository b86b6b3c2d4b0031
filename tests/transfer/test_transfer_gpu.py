"""The transfer layer on a real device: packing, the pinned pool, DeviceLoader, HostMirror,
AsyncScalars, snapshots and one-off uploads."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader, upload_tokens
from gpuflow.transfer.mirror import HostMirror, host_snapshot
from gpuflow.transfer.packing import pack, unpack
from gpuflow.transfer.pinned import PinnedPool
from gpuflow.transfer.scalars import AsyncScalars

pytestmark = pytest.mark.gpu


def _busy(device: Device, ms: float = 30.0) -> None:
    """Keep the current stream busy for about ``ms`` (a spin kernel), so copies queue behind."""
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * 2e6))  # cycles: at least ms at clocks up to 2 GHz


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


def _late_copies(loader: DeviceLoader) -> DeviceLoader:
    """Stall the stream that runs each crossing's copies for 5 ms just before them (the side
    stream after its wait for the consumer, or the consumer's own), so that a consumer
    reading before a copy finished would see the memory's previous contents: garbage, or a
    batch the allocator handed back."""
    issuer = loader._pipeline.issuer
    copy = issuer._copy

    def late(crossing, stream):
        _busy(loader._pipeline.device, 5.0)
        return copy(crossing, stream)

    issuer._copy = late
    return loader


@pytest.mark.parametrize(
    "n_floats, n_batches",
    # 16 MiB on the side stream and 1 MiB on the consumer's stream, both pinned by
    # pin_memory() and copied into tensors of their own; 16 KiB, staged and coalesced
    [(1 << 22, 12), (1 << 18, 40), (1 << 12, 400)],
    ids=["large", "medium", "coalesced"],
)
def test_the_consumer_never_sees_a_batch_before_its_copy_finished(accel, n_floats, n_batches):
    source = (np.full(n_floats, float(i), dtype=np.float32) for i in range(n_batches))
    ok = torch.ones((), dtype=torch.bool, device=accel.torch)
    with _late_copies(DeviceLoader(source, accel, depth=2)) as loader:
        for i, batch in enumerate(loader):
            ok &= (batch == float(i)).all()  # every element, on the consumer's stream
    assert bool(ok.item())
    assert loader.stats.batches == n_batches
    if n_floats < 1 << 16:
        assert loader.stats.copies < n_batches / 10


def test_a_batch_taken_on_another_stream_waits_for_its_copy(accel):
    """Batch i + 1 is copied on the stream current while batch i was taken; taking it under
    another stream must make that stream wait for the copy."""
    if accel.type != "cuda":
        pytest.skip("cuda streams")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    n_batches = 30
    source = (np.full(1 << 18, float(i), dtype=np.float32) for i in range(n_batches))
    oks = [torch.ones((), dtype=torch.bool, device=accel.torch) for _ in streams]
    with _late_copies(DeviceLoader(source, accel, depth=2)) as loader:
        batches, kept = iter(loader), []
        for i in range(n_batches):
            with torch.cuda.stream(streams[i % 2]):
                kept.append(next(batches))  # kept: no block goes back across streams
                oks[i % 2] &= (kept[-1] == float(i)).all()
    torch.cuda.synchronize()
    assert all(bool(ok.item()) for ok in oks)


def test_a_batch_let_go_of_is_not_overwritten_while_the_consumer_still_reads_it(accel):
    """The consumer's stream runs far behind: each batch is read 2 ms after it is taken and
    then dropped, so the allocator hands its memory to a later copy at once. The copy must
    wait for the read (the copy stream waits for the consumer's queued work)."""
    n_batches = 40
    source = (np.full(1 << 20, float(i), dtype=np.float32) for i in range(n_batches))
    ok = torch.ones((), dtype=torch.bool, device=accel.torch)
    with DeviceLoader(source, accel, depth=4) as loader:
        for i, batch in enumerate(loader):
            _busy(accel, 2.0)
            ok &= (batch == float(i)).all()
            del batch
    assert bool(ok.item())


def test_loader_memory_is_flat_and_copies_overlap_compute(accel):
    batch = torch.randn(1 << 20)  # 4 MB
    reserved = []
    with DeviceLoader(itertools.repeat(batch, 2000), accel, timing=True) as loader:
        for i, on_device in enumerate(loader, start=1):
            _busy(accel, 1.0)  # compute that the next copy can hide behind
            on_device.sum()
            if i in (100, 2000):
                accel.synchronize()
                reserved.append(
                    (loader.pool_stats.bytes_reserved, torch.cuda.memory_reserved(accel.torch))
                )
    assert reserved[0] == reserved[1]
    stats = loader.stats
    assert stats.overlap_ms > 0.8 * stats.transfer_ms  # the copies hid behind the compute


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
    assert loader.pool_stats.misses == 0  # nothing was staged


def test_direct_tensors_arrive_intact_beside_staged_ones_and_in_coalesced_runs(accel):
    """Pinned 128 and 64 KiB tensors are copied into device tensors of their own, small labels
    go through the staging buffer, and five such batches share one crossing: every batch must
    come back whole, also when the source frees and re-pins its memory at once."""
    if not accel.supports_pinned_memory:
        pytest.skip("no pinned memory on this backend")

    def source():
        for i in range(40):
            yield {
                "x": torch.full((1 << 15,), float(i)).pin_memory(),  # 128 KiB: direct
                "label": torch.tensor([i, i + 1]),  # staged, narrowed
                "y": torch.full((1 << 14,), -float(i)).pin_memory(),  # 64 KiB: direct
            }

    ok = torch.ones((), dtype=torch.bool, device=accel.torch)
    with _late_copies(DeviceLoader(source(), accel, depth=2, narrow=True)) as loader:
        for i, batch in enumerate(loader):
            ok &= (batch["x"] == float(i)).all() & (batch["y"] == -float(i)).all()
            ok &= (batch["label"] == torch.tensor([i, i + 1], device=accel.torch)).all()
            assert batch["x"].shape == (1 << 15,) and batch["label"].dtype == torch.int64
    assert bool(ok.item())
    stats = loader.stats
    assert stats.batches == 40 and stats.copies < 3 * 40  # labels shared copies


def test_host_mirror_partial_reads_and_async_refresh(accel):
    table = torch.randn(4096, 1024, device=accel.torch)  # 16 MB
    mirror = HostMirror(table)
    assert mirror[7, 5] == pytest.approx(table[7, 5].item())
    assert mirror.stats.bytes_fetched == 4
    _busy(accel, 500.0)
    table.mul_(2.0)  # queued behind the busy kernel
    mirror.refresh_async()
    # Queued, not waited for: the stream is still busy when it returns (a clock-free check:
    # a bound on the call's time failed on a host shared with other test processes).
    assert not torch.cuda.current_stream(accel.torch).query()
    np.testing.assert_array_equal(mirror.numpy(), table.cpu().numpy())


def _graph_that_adds_one(accel) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
    """A (16,) device tensor and a captured graph whose replay adds 1 to it: a write that
    bumps no version counter."""
    state = torch.zeros(16, device=accel.torch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        state.add_(1)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.add_(1)
    return state, graph


def test_host_mirror_needs_mark_dirty_after_a_graph_replay(accel):
    if accel.type != "cuda":
        pytest.skip("CUDA graphs")
    state, graph = _graph_that_adds_one(accel)
    mirror = HostMirror(state, writes="tracked")
    before = mirror.numpy()[0]
    graph.replay()
    assert mirror.is_fresh()  # the replay did not bump the version: the mirror cannot know
    mirror.mark_dirty()
    assert mirror.numpy()[0] == before + 1


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


def test_a_snapshot_of_mostly_host_tensors_stages_only_the_device_ones(accel):
    """The split optimizer's checkpoint: masters and moments gathered on the host, a few
    device tensors between them; the staging buffer holds those few, every byte arrives."""
    from gpuflow.transfer.snapshot import StateSnapshot

    state = {
        "model": {
            "big": torch.randn(1 << 20),  # host, fp32
            "h": torch.randn(333, device=accel.torch).to(torch.bfloat16),
            "w": torch.randn(77, device=accel.torch),
        },
        "optimizer": {
            "m": torch.randn(1 << 20),
            "step": torch.tensor(3.0, device=accel.torch),
            "n": torch.arange(5, device=accel.torch),  # int64 after fp32 bytes
        },
    }
    expected = {g: {k: v.cpu() for k, v in t.items()} for g, t in state.items()}
    snapshots = StateSnapshot(accel)
    snap = snapshots.capture(state)
    snap.wait()
    for group, tensors in expected.items():
        for name, tensor in tensors.items():
            assert torch.equal(snap.tensors(group)[name], tensor), name
    snap.release()
    device_bytes = sum(
        t.numel() * t.element_size() for g in state.values() for t in g.values() if t.is_cuda
    )
    assert snapshots._staging.numel() < device_bytes + 4 * 64  # the device spans, packed


def test_a_dataloader_with_workers_is_pinned_on_the_reader_thread_and_arrives_intact(accel):
    if not accel.supports_pinned_memory:
        pytest.skip("no pinned memory on this backend")
    from gpuflow.bench.workloads import SyntheticImages

    data = SyntheticImages(6 * 128, 64)  # uint8 3x64x64 images of 12 KiB
    source = torch.utils.data.DataLoader(data, batch_size=128, num_workers=2)  # 1.5 MiB each
    expected = [b["image"].clone() for b in source]
    with _late_copies(DeviceLoader(source, accel)) as loader:
        for _ in range(2):  # epochs
            got = [b["image"].cpu() for b in loader]
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert loader.stats.batches == 2 * len(expected)


def test_closing_a_loader_that_pinned_nothing_of_its_own_keeps_torchs_pinned_cache(accel):
    """Pageable batches of 1 MiB are pinned by pin_memory() (torch's cached blocks); closing
    the loader must not hand those blocks back, or the next loader pins them anew."""
    if accel.type != "cuda":
        pytest.skip("torch.cuda.host_memory_stats")
    batches = [torch.full((1 << 18,), float(i)) for i in range(8)]
    for _ in range(2):  # the first round fills torch's cache
        with DeviceLoader(batches, accel) as loader:
            for i, batch in enumerate(loader):
                assert bool((batch == float(i)).all())
        assert loader.pool_stats.misses == 0  # nothing was staged
        frees = torch.cuda.host_memory_stats().get("num_host_free", 0)
    # torch reuses a pinned block once the copy recorded on it has finished: wait for them
    # all, or a block still in flight makes the next loader's pin a new allocation.
    torch.cuda.synchronize()
    allocs = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    with DeviceLoader(batches, accel) as loader:
        for _ in loader:
            pass
    stats = torch.cuda.host_memory_stats()
    assert stats.get("num_host_free", 0) == frees and stats.get("num_host_alloc", 0) == allocs


# ---- mirrors and snapshots as users met them in their own loops ---------------------------


@pytest.mark.parametrize("writes", ["unknown", "tracked"])
def test_host_mirror_of_a_device_parameter_is_fresh_after_a_fused_adamw_step(accel, writes):
    if not accel.supports_fused_adamw:
        pytest.skip("fused AdamW")
    from gpuflow import HostMirror

    param = torch.nn.Parameter(torch.randn(256, 64, device=accel.torch))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    mirror = HostMirror(param, writes=writes)
    mirror.numpy()
    for _ in range(2):
        param.grad = torch.randn_like(param)
        optimizer.step()
        assert not mirror.is_fresh()  # the fused kernel left the version counter alone
        np.testing.assert_array_equal(mirror.numpy(), param.detach().cpu().numpy())
        assert mirror[3, 5] == param[3, 5].item()


def test_a_default_host_mirror_sees_a_graph_replay_without_mark_dirty(accel):
    if accel.type != "cuda":
        pytest.skip("CUDA graphs")
    from gpuflow import HostMirror

    state, graph = _graph_that_adds_one(accel)
    mirror = HostMirror(state)
    before = mirror.numpy()[0]
    graph.replay()
    assert not mirror.is_fresh()  # it cannot know, so it does not claim to
    assert mirror.numpy()[0] == before + 1


def test_a_tracked_host_mirror_follows_new_device_memory_behind_a_parameter(accel):
    from gpuflow import HostMirror

    param = torch.nn.Parameter(torch.zeros(1024, device=accel.torch))
    mirror = HostMirror(param, writes="tracked")
    mirror.numpy()
    param.data = torch.full((4, 8), 3.0, device=accel.torch)  # what `model.to()` paths do
    assert not mirror.is_fresh()
    np.testing.assert_array_equal(mirror.numpy(), np.full((4, 8), 3.0, dtype=np.float32))
    param.data.resize_(4096)  # new device memory under the same (4, 8) view
    param.data.fill_(5.0)
    assert mirror.numpy().tolist() == [[5.0] * 8] * 4
    mirror.numpy()
    assert mirror.is_fresh() and mirror.stats.hits == 1  # unchanged: served from the copy


def test_async_scalars_take_one_name_on_the_device(accel):
    from gpuflow import AsyncScalars

    scalars = AsyncScalars("loss", accel)
    for v in (1.0, 3.0):
        scalars.add(loss=torch.tensor(v, device=accel.torch))
    assert scalars.drain(1) == [(1, {"loss": 2.0})]


def test_a_second_snapshot_capture_before_release_raises_on_the_device(accel):
    import threading

    from gpuflow import StateSnapshot

    state = {"model": {"w": torch.randn(4096, device=accel.torch)}}
    outcome: list = []

    def loop() -> None:
        snapshots = StateSnapshot(accel)
        first = snapshots.capture(state)
        try:
            snapshots.capture(state)
        except RuntimeError as exc:
            outcome.append(exc)
        first.wait()
        first.release()
        again = snapshots.capture(state)
        again.wait()
        outcome.append(torch.equal(again.tensors("model")["w"], state["model"]["w"].cpu()))
        again.release()

    thread = threading.Thread(target=loop, daemon=True)  # a hang fails, not stalls, the run
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "capture() hung"
    assert isinstance(outcome[0], RuntimeError) and outcome[1:] == [True]
