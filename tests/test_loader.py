"""DeviceLoader on the cpu path: order, structure, errors, shutdown and accounting."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.pinned import size_class


def token_batches(n: int, shape=(4, 9)):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 16000, size=shape, dtype=np.int64).astype(np.uint16) for _ in range(n)]


def test_batches_arrive_in_order_and_intact():
    batches = token_batches(50)
    with DeviceLoader(iter(batches), "cpu", depth=3) as loader:
        got = [batch.clone() for batch in loader]
    assert len(got) == 50
    for sent, received in zip(batches, got, strict=True):
        assert received.dtype == torch.uint16
        assert np.array_equal(received.numpy(), sent)


def test_nested_float_and_uint8_batches_with_codecs():
    rng = np.random.default_rng(1)

    def source():
        for i in range(10):
            yield {
                "image": rng.integers(0, 256, (2, 3, 8, 8), dtype=np.uint8),
                "target": torch.tensor([i, i + 1]),
                "features": torch.full((5,), float(i)),
                "name": f"batch{i}",
            }

    with DeviceLoader(source(), "cpu", lossy_float="bf16") as loader:
        seen = [
            (b["name"], b["target"].tolist(), b["features"].dtype, b["image"].dtype) for b in loader
        ]
    assert seen[3] == ("batch3", [3, 4], torch.float32, torch.uint8)
    stats = loader.stats
    assert stats.batches == stats.copies == 10
    # int64 targets cross as uint16, floats as bf16, images as they are
    assert stats.bytes_moved < stats.logical_bytes


class Boom(Exception):
    pass


def test_an_error_in_the_source_reaches_the_consumer_with_its_traceback():
    def source():
        yield np.zeros(4, dtype=np.int64)
        raise Boom("bad record 17")

    loader = DeviceLoader(source(), "cpu")
    assert next(loader).tolist() == [0, 0, 0, 0]
    with pytest.raises(Boom, match="bad record 17") as info:
        next(loader)
    frames = [entry.name for entry in info.traceback]
    assert "source" in frames  # the frame that raised, in the loader thread
    assert not loader._producer.thread.is_alive()


def test_a_packing_error_is_raised_too():
    loader = DeviceLoader(iter([torch.tensor([1e6])]), "cpu", lossy_float="fp16")
    with pytest.raises(GpuflowError, match="fp16"):
        next(loader)


def test_closing_early_stops_the_thread_even_when_it_is_blocked():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield np.full(1000, i, dtype=np.int64)
            i += 1

    loader = DeviceLoader(endless(), "cpu", depth=2)
    first = next(loader)
    assert first[0].item() == 0
    time.sleep(0.2)  # the thread fills every slot and blocks
    assert len(produced) <= 2 + 2 + 1  # depth slots, a packed queue of depth, one in hand
    loader.close()
    assert not loader._producer.thread.is_alive()
    assert loader._producer.pool.stats.bytes_reserved == 0
    with pytest.raises(StopIteration):
        next(loader)


def test_a_dead_thread_never_leaves_the_consumer_hanging(monkeypatch):
    release = threading.Event()

    def source():
        yield np.zeros(3)
        release.wait()  # the real thread parks here, with nothing more to give

    loader = DeviceLoader(source(), "cpu")
    next(loader)
    # Simulate the thread killed from outside: gone, with no result and no end marker.
    monkeypatch.setattr(loader._producer, "thread", threading.Thread(target=lambda: None))
    loader._producer.thread.start()
    loader._producer.thread.join()
    try:
        with pytest.raises(RuntimeError, match="died without a result"):
            next(loader)
    finally:
        release.set()


def test_memory_is_flat_after_warm_up():
    batches = (np.full((64, 129), i % 1000, dtype=np.uint16) for i in range(600))
    with DeviceLoader(batches, "cpu", depth=2) as loader:
        seen = []
        for i, _ in enumerate(loader):
            if i in (50, 599):
                slots = tuple(slot.buffer.data_ptr() for slot in loader._producer.slots)
                seen.append((loader._producer.pool.stats.bytes_reserved, slots))
    assert seen[0] == seen[1]  # the same pinned bytes and the same two device slots
    assert seen[0][0] > 0 and len(set(seen[0][1])) == 2
    # Staging never pinned more than one buffer per slot (more was slower: NOTES.md).
    assert loader._producer.pool.stats.high_water_bytes <= 2 * size_class(64 * 129 * 2)


def test_stats_count_bytes_stall_and_overlap():
    def slow_source():
        for i in range(5):
            time.sleep(0.02)
            yield np.full(1024, i, dtype=np.float32)

    with DeviceLoader(slow_source(), "cpu", depth=2) as loader:
        for _ in loader:
            time.sleep(0.01)  # "compute"
    stats = loader.stats
    assert (stats.batches, stats.copies) == (5, 5)
    assert stats.bytes_moved == stats.logical_bytes == 5 * 4096
    assert stats.stall_s > 0.02  # the consumer outran a slow source
    assert stats.compute_ms >= 5 * 10 * 0.8
    assert 0 <= stats.overlap_efficiency <= 1


def test_depth_must_be_positive():
    with pytest.raises(GpuflowError, match="depth"):
        DeviceLoader([], "cpu", depth=0)


def test_closing_wakes_a_thread_waiting_for_a_staging_buffer():
    # A cap of one buffer: the thread packs one batch, then waits for the pool.
    big = np.zeros(1 << 16, dtype=np.float32)
    loader = DeviceLoader(itertools.repeat(big), "cpu", depth=1, pool_bytes=1 << 18)
    iter(loader)  # the thread starts with the epoch
    time.sleep(0.2)
    assert loader._producer.thread.is_alive()
    loader.close()
    assert not loader._producer.thread.is_alive()


def test_a_torch_device_is_accepted_wherever_a_device_is():
    assert Device.resolve(torch.device("cpu")) == Device("cpu")
    batches = token_batches(3)
    with DeviceLoader(iter(batches), torch.device("cpu")) as loader:
        assert [b.tolist() for b in loader] == [b.tolist() for b in batches]


# ---- lifetime: like a DataLoader, and nothing left behind -----------------------------------


def _loader_threads() -> int:
    return sum(t.name == "gpuflow-loader" for t in threading.enumerate())


def test_the_thread_starts_with_an_epoch_and_each_epoch_reuses_slots_and_pinned_memory():
    batches = [np.full((8, 33), i, dtype=np.uint16) for i in range(5)]
    before = _loader_threads()
    loader = DeviceLoader(batches, "cpu")
    assert _loader_threads() == before  # constructing starts nothing
    assert len(loader) == 5
    epochs, memory = [], []
    for _ in range(3):
        epochs.append([b.tolist() for b in loader])
        slots = tuple(slot.buffer.data_ptr() for slot in loader._producer.slots)
        memory.append((loader._producer.pool.stats.bytes_reserved, slots))
    assert epochs[0] == epochs[1] == epochs[2] == [b.tolist() for b in batches]
    assert memory[0] == memory[1] == memory[2]
    loader.close()
    assert _loader_threads() == before


def test_breaking_out_then_iterating_again_starts_a_fresh_epoch():
    batches = [np.full(4, i, dtype=np.int64) for i in range(6)]
    with DeviceLoader(batches, "cpu") as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert [b[0].item() for b in loader] == list(range(6))


def test_an_iterator_source_gives_one_epoch_and_says_so():
    loader = DeviceLoader(iter([np.zeros(3)] * 2), "cpu")
    assert len(list(loader)) == 2
    with pytest.raises(GpuflowError, match="used up by its first epoch"):
        iter(loader)
    with pytest.raises(TypeError, match="has no len"):
        len(loader)
    loader.close()


def test_a_dropped_loader_stops_its_thread_and_closes_its_source():
    import gc

    closed = threading.Event()

    def endless():
        try:
            while True:
                yield np.zeros(1000)
        finally:
            closed.set()

    before = _loader_threads()
    loader = DeviceLoader(endless(), "cpu")
    next(loader)
    assert _loader_threads() == before + 1
    del loader
    gc.collect()
    assert _loader_threads() == before
    assert closed.wait(2)  # the generator's finally ran, in its own thread


def test_close_returns_promptly_from_a_blocked_source():
    never = queue.Queue()

    def blocked():
        yield np.zeros(3)
        yield never.get()  # blocks forever

    loader = DeviceLoader(blocked(), "cpu")
    next(loader)
    started = time.monotonic()
    loader.close(timeout=0.2)
    assert time.monotonic() - started < 1.0
    with pytest.raises(GpuflowError, match="closed"):
        iter(loader)


def test_an_epoch_and_its_close_fit_in_a_budget_of_no_waits():
    from gpuflow.accounting.budgets import budget

    batches = [np.zeros((4, 8), dtype=np.float32) for _ in range(3)]
    loader = DeviceLoader(batches, "cpu")
    with budget(syncs=0, device="cpu"):
        for _ in loader:
            pass
        loader.close()  # its waits are the loader's own housekeeping


def test_an_exception_in_the_loop_without_with_exits_with_its_status(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(
        "import numpy as np\n"
        "from gpuflow import DeviceLoader\n"
        "loader = DeviceLoader((np.zeros(1000) for _ in range(10**6)), 'cpu')\n"
        "for i, batch in enumerate(loader):\n"
        "    if i == 3:\n"
        "        raise ValueError('the loop failed')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "ValueError: the loop failed" in done.stderr
    assert "terminate called" not in done.stderr


def test_a_pool_too_small_for_a_batch_names_the_loaders_knob():
    loader = DeviceLoader([np.zeros(1 << 20, dtype=np.float32)], "cpu", pool_bytes=1 << 16)
    with pytest.raises(GpuflowError, match="raise DeviceLoader's pool_bytes"):
        next(loader)
    loader.close()


def test_batches_are_their_own_whatever_their_dtype_unless_views_are_asked_for():
    floats = [np.full(256, i, dtype=np.float32) for i in range(6)]  # cross unchanged
    ints = [np.full(256, i, dtype=np.int64) for i in range(6)]  # narrowed to uint16
    for source in (floats, ints):
        with DeviceLoader(source, "cpu") as loader:
            kept = list(loader)  # every batch held past the next ones
        assert [b[0].item() for b in kept] == list(range(6))
    with DeviceLoader(floats, "cpu", depth=2, views=True) as loader:
        kept = list(loader)
        slots = {slot.buffer.data_ptr() for slot in loader._producer.slots}
    assert {b.data_ptr() for b in kept} <= slots  # views of the two reused slots
    assert [b[0].item() for b in kept] != list(range(6))  # so early ones were overwritten
