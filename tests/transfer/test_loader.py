"""DeviceLoader on the cpu path: order, structure, errors, shutdown and accounting."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader, LoaderStats
from gpuflow.transfer.pinned import size_class
from tests.helpers import child_env


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
    assert stats.batches == 10
    assert stats.copies < 10  # small batches share copies
    # int64 targets cross as uint16, floats as bf16, images as they are
    assert stats.bytes_moved < stats.logical_bytes


class Boom(Exception):
    pass


def test_a_second_thread_reading_one_epoch_at_once_is_refused_not_fed_twice():
    entered, gate = threading.Event(), threading.Event()

    def source():
        entered.set()
        assert gate.wait(30)
        yield torch.zeros(2)
        yield torch.ones(2)

    with DeviceLoader(source(), "cpu") as loader:
        epoch, first = iter(loader), []
        reader = threading.Thread(target=lambda: first.append(next(epoch)))
        reader.start()
        assert entered.wait(30)  # the reader is inside next(), waiting for the source
        with pytest.raises(GpuflowError, match="read by another thread; give each thread"):
            next(epoch)
        gate.set()
        reader.join(timeout=30)
        assert [b.tolist() for b in first] == [[0.0, 0.0]]
        assert next(epoch).tolist() == [1.0, 1.0]  # the refused call took nothing


@pytest.mark.parametrize("coalesce", [True, False])
def test_empty_containers_come_back_as_given(coalesce):
    # Batches of one layout are rebuilt as a run: a container with nothing in it is still one
    # empty container a batch, beside tensors or alone.
    batches = [{"x": torch.full((4,), float(i)), "tags": [], "meta": {}, "t": ()} for i in range(3)]
    with DeviceLoader(batches, "cpu", coalesce=coalesce) as loader:
        got = list(loader)
    assert [b["x"].tolist() for b in got] == [[float(i)] * 4 for i in range(3)]
    assert all(b["tags"] == [] and b["meta"] == {} and b["t"] == () for b in got)
    for empty in ([(), ()], [[], []], [{}, {}]):
        with DeviceLoader(empty, "cpu", coalesce=coalesce) as loader:
            assert list(loader) == empty


def test_an_error_in_the_source_reaches_the_consumer_with_its_traceback():
    def source():
        yield np.zeros(4, dtype=np.int64)
        raise Boom("bad record 17")

    loader = DeviceLoader(source(), "cpu")
    assert next(loader).tolist() == [0, 0, 0, 0]
    with pytest.raises(Boom, match="bad record 17") as info:
        next(loader)
    frames = [entry.name for entry in info.traceback]
    assert "source" in frames  # the frame that raised
    with pytest.raises(StopIteration):  # the epoch ended with the error
        next(loader)


def test_an_error_read_ahead_waits_for_the_batches_before_it():
    def source():
        for i in range(3):
            yield np.full(4, i, dtype=np.int64)
        raise Boom("bad record 3")

    loader = DeviceLoader(source(), "cpu", depth=2)
    got = []
    with pytest.raises(Boom):
        for batch in loader:
            got.append(batch[0].item())
    assert got == [0, 1, 2]


def test_a_packing_error_is_raised_too():
    loader = DeviceLoader(iter([torch.tensor([1e6])]), "cpu", lossy_float="fp16")
    with pytest.raises(GpuflowError, match="fp16"):
        next(loader)


def test_reading_ahead_is_bounded_and_closing_frees_the_staging_memory():
    produced = []
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                produced.append(i)
                yield np.full(1000, i, dtype=np.int64)
                i += 1
        finally:
            closed.set()

    loader = DeviceLoader(endless(), "cpu", depth=2)
    assert next(loader)[0].item() == 0
    # depth + 1 staging buffers of at most 32 coalesced small batches, one planned beyond
    assert 2 <= len(produced) <= 3 * 32 + 1
    assert loader.stats.copies < len(produced)
    loader.close()
    assert closed.is_set()  # the generator's finally ran
    assert loader.pool_stats.bytes_reserved == 0
    with pytest.raises(GpuflowError, match="closed"):  # not an end that looks normal
        next(loader)


def test_depth_zero_reads_nothing_ahead_for_a_source_that_waits_on_the_consumer():
    answers: queue.Queue[int] = queue.Queue()

    def actor():  # each batch needs the learner's answer to the one before
        value = 0
        for _ in range(4):
            yield np.full(8, value, dtype=np.int64)
            value = answers.get(timeout=5) + 1

    seen = []
    with DeviceLoader(actor(), "cpu", depth=0) as loader:
        for batch in loader:
            seen.append(batch[0].item())
            answers.put(seen[-1] * 10)
    assert seen == [0, 1, 11, 111]


def test_memory_is_flat_after_warm_up():
    for shape in ((64, 129), (1024, 1024)):  # coalesced; 2 MiB each, alone
        batches = (np.full(shape, i % 1000, dtype=np.uint16) for i in range(400))
        with DeviceLoader(batches, "cpu", depth=2) as loader:
            seen = []
            for i, _ in enumerate(loader):
                if i in (50, 250):
                    seen.append(loader.pool_stats.bytes_reserved)
        assert seen[0] == seen[1] > 0  # the same pinned bytes
        # depth + 2 staging buffers at most: read ahead, and one whose copy may still run
        crossing = max(2 * 64 * 129 * 32, 2 * 1024 * 1024)
        assert loader.pool_stats.high_water_bytes <= 4 * size_class(crossing)


def test_stats_count_bytes_stall_and_overlap():
    def slow_source():
        for i in range(5):
            time.sleep(0.02)
            yield np.full(1024, i, dtype=np.float32)

    with DeviceLoader(slow_source(), "cpu", depth=2, timing=True) as loader:
        for _ in loader:
            time.sleep(0.01)  # "compute"
    stats = loader.stats
    assert stats.batches == 5 and 1 <= stats.copies < 5
    assert stats.bytes_moved == stats.logical_bytes == 5 * 4096
    assert stats.source_s > 5 * 0.02 * 0.8  # the consumer outran a slow source
    assert stats.compute_ms >= 5 * 10 * 0.8


@pytest.mark.parametrize(
    "transfer, exposed, compute, expected",
    [
        (4.0, 0.0, 10.0, 0.4),  # every copy ran under compute that took longer
        (10.0, 0.0, 4.0, 1.0),  # the compute ran wholly under longer copies
        (10.0, 10.0, 4.0, 0.0),  # the consumer waited for every copy
        (10.0, 6.0, 8.0, 0.4),  # 4 ms of the copies hidden, the longer side 10 ms
        (0.0, 0.0, 0.0, 0.0),  # nothing timed
    ],
)
def test_overlap_efficiency_is_the_hidden_copy_time_over_the_longer_side(
    transfer, exposed, compute, expected
):
    stats = LoaderStats(1, 1, 0, 0, 0.0, 0.0, transfer, exposed, compute)
    assert stats.overlap_efficiency == pytest.approx(expected)


def test_a_negative_depth_is_refused_and_depth_zero_reads_on_demand():
    with pytest.raises(GpuflowError, match="depth"):
        DeviceLoader([], "cpu", depth=-1)
    with DeviceLoader(iter([np.zeros(4), np.ones(4)]), "cpu", depth=0) as loader:
        assert [b.sum().item() for b in loader] == [0.0, 4.0]


@pytest.mark.parametrize("device", [True, 1.5, ["cpu"]])
def test_a_device_that_is_no_name_index_or_torch_device_is_refused_in_words(device):
    with pytest.raises(GpuflowError, match="a device is a name"):
        Device.resolve(device)
    with pytest.raises(GpuflowError, match="a device is a name"):
        DeviceLoader([torch.ones(3)], device)


def test_a_torch_device_is_accepted_wherever_a_device_is():
    assert Device.resolve(torch.device("cpu")) == Device("cpu")
    batches = token_batches(3)
    with DeviceLoader(iter(batches), torch.device("cpu")) as loader:
        assert [b.tolist() for b in loader] == [b.tolist() for b in batches]


# ---- lifetime: like a DataLoader, and nothing left behind -----------------------------------


def _writer_threads() -> int:
    return sum(t.name.startswith("gpuflow-write") for t in threading.enumerate())


def _writers_back_to(count: int, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while _writer_threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _writer_threads() == count


def test_epochs_reuse_pinned_memory_and_only_large_batches_start_writer_threads():
    before = _writer_threads()
    for shape, threads in (((8, 33), 0), ((2048, 2048), 1)):  # coalesced; 16 MiB each, alone
        batches = [np.full(shape, i, dtype=np.float32) for i in range(5)]
        loader = DeviceLoader(batches, "cpu")
        assert _writer_threads() == before  # constructing starts nothing
        assert len(loader) == 5
        epochs, memory = [], []
        for _ in range(3):
            epochs.append([b[0, 0].item() for b in loader])
            assert (_writer_threads() > before) == bool(threads)
            memory.append(loader.pool_stats.bytes_reserved)
        assert epochs[0] == epochs[1] == epochs[2] == list(range(5))
        assert memory[0] == memory[1] == memory[2] > 0
        loader.close()
        assert loader.pool_stats.bytes_reserved == 0
        assert _writers_back_to(before)


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
    with pytest.raises(GpuflowError, match="an iterator, which serves one epoch"):
        iter(loader)
    with pytest.raises(TypeError, match="has no len"):
        len(loader)
    loader.close()


def test_a_dropped_loader_frees_its_pinned_memory_and_closes_its_source():
    import gc

    closed = threading.Event()

    def endless():
        try:
            while True:
                yield np.zeros(1 << 21)  # 16 MiB: staged on the writer threads
        finally:
            closed.set()

    loader = DeviceLoader(endless(), "cpu")
    next(loader)
    pool = loader._pipeline.pool
    assert pool.stats.bytes_reserved > 0
    assert _writer_threads() > 0
    del loader
    gc.collect()
    assert pool.stats.bytes_reserved == 0
    assert closed.is_set()  # the generator's finally ran
    assert _writers_back_to(0)


def test_ctrl_c_leaves_a_loop_blocked_in_its_source_promptly(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "blocked.py"
    script.write_text(
        "import queue\n"
        "import numpy as np\n"
        "from gpuflow import DeviceLoader\n"
        "never = queue.Queue()\n"
        "def blocked():\n"
        "    yield np.zeros(3)\n"
        "    print('blocked', flush=True)\n"
        "    yield never.get()\n"
        "with DeviceLoader(blocked(), 'cpu') as loader:\n"
        "    for batch in loader:\n"
        "        pass\n"
    )
    child = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "blocked"
    child.send_signal(signal.SIGINT)
    started = time.monotonic()
    _, err = child.communicate(timeout=10)
    assert time.monotonic() - started < 2.0
    assert child.returncode != 0 and "KeyboardInterrupt" in err
    assert "terminate called" not in err


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
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "ValueError: the loop failed" in done.stderr
    assert "terminate called" not in done.stderr


def test_the_bytes_counted_are_the_bytes_the_copies_move_padding_included():
    # A uint8 then a float64: 15 bytes of padding between them and 8 after, which the staging
    # copy carries too; coalesced, the four batches cross in one copy of 4 x 32 bytes.
    from gpuflow.accounting.ledger import TransferLedger
    from gpuflow.transfer.packing import plan_pack

    batches = [(torch.ones(1, dtype=torch.uint8), torch.ones(1, dtype=torch.float64))] * 4
    share = plan_pack(batches[0]).nbytes
    assert share == 32
    with TransferLedger("cpu") as ledger, DeviceLoader(batches, "cpu") as loader:
        assert len(list(loader)) == 4
    assert loader.stats.bytes_moved == ledger.summary().totals.h2d_bytes == 4 * share


@pytest.mark.parametrize("pool_bytes", [1 << 16, 16])  # 16: below any buffer's least size
def test_a_pool_too_small_for_a_batch_names_the_loaders_knob(pool_bytes):
    loader = DeviceLoader([np.zeros(1 << 20, dtype=np.float32)], "cpu", pool_bytes=pool_bytes)
    with pytest.raises(GpuflowError, match="raise pool_bytes"):
        next(loader)
    loader.close()


@pytest.mark.parametrize("pool_bytes", [-1, 1.5, True])
def test_a_pool_size_that_is_no_byte_count_is_refused(pool_bytes):
    with pytest.raises(GpuflowError, match="pool_bytes must be a whole number of bytes"):
        DeviceLoader([torch.ones(3)], "cpu", pool_bytes=pool_bytes)


def test_batches_are_their_own_whatever_their_dtype():
    floats = [np.full(256, i, dtype=np.float32) for i in range(6)]  # cross unchanged
    ints = [np.full(256, i, dtype=np.int64) for i in range(6)]  # narrowed to uint16
    large = [np.full(1 << 19, i, dtype=np.float32) for i in range(6)]  # 2 MiB: one each
    for source in (floats, ints, large):
        with DeviceLoader(source, "cpu", narrow=True) as loader:
            kept = list(loader)  # every batch held past the next ones
        assert [b[0].item() for b in kept] == list(range(6))
        assert [b[-1].item() for b in kept] == list(range(6))


def test_without_coalescing_every_batch_is_its_own_copy():
    with DeviceLoader(token_batches(40), "cpu", coalesce=False) as loader:
        assert len(list(loader)) == 40
    assert loader.stats.copies == loader.stats.batches == 40


def test_coalesced_batches_of_changing_layouts_arrive_intact():
    """Batches sharing one copy in runs of like layouts (rebuilt a run at a time), the runs
    broken by a new shape and by ids that no longer narrow to uint16."""
    batches = []
    for i in range(60):
        width = 3 if i % 20 < 10 else 5
        ids = [i, 70000] if i % 7 == 0 else [i, i + 1]
        batches.append({"x": torch.full((2, width), float(i)), "ids": torch.tensor(ids)})
    with DeviceLoader(batches, "cpu", narrow=True) as loader:
        got = list(loader)
    assert loader.stats.copies < 10
    for sent, received in zip(batches, got, strict=True):
        assert torch.equal(received["x"], sent["x"])
        assert received["ids"].dtype == torch.int64 and torch.equal(received["ids"], sent["ids"])


# ---- epochs, as a DataLoader's ----------------------------------------------------------------


def test_each_iter_is_an_epoch_of_its_own():
    loader = DeviceLoader([torch.tensor([i]) for i in range(3)], "cpu")
    assert [(a.item(), b.item()) for a, b in zip(loader, loader, strict=True)] == [
        (0, 0), (1, 1), (2, 2)
    ]  # fmt: skip
    pairs = [(a.item(), b.item()) for a in loader for b in loader]
    assert pairs == [(a, b) for a in range(3) for b in range(3)]
    first = iter(loader)
    assert next(first).item() == 0
    second = iter(loader)  # does not restart the first
    assert [b.item() for b in second] == [0, 1, 2]
    assert [b.item() for b in first] == [1, 2]
    with pytest.raises(StopIteration):
        next(first)


def test_an_epoch_left_early_lets_go_of_what_it_read_ahead():
    closed = threading.Event()

    def source():
        try:
            yield from (np.full(4, i) for i in range(100))
        finally:
            closed.set()

    class Source:
        def __iter__(self):
            return source()

    loader = DeviceLoader(Source(), "cpu")
    for batch in loader:
        if batch[0] == 2:
            break
    assert closed.is_set()  # the abandoned epoch's generator was closed
    assert [b[0].item() for b in loader][:3] == [0, 1, 2]  # and the next epoch starts over
