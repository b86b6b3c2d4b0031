"""PinnedPool: size classes, the byte cap, reuse only after a copy's event, cleanup."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.pinned import PinnedPool, size_class


class CopyInFlight:
    """An event for a copy that finishes when the test says (or when someone waits on it)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_size_classes_are_powers_of_two_with_a_floor():
    assert [size_class(n) for n in (0, 1, 4096, 4097, 5000, 1 << 20)] == [
        4096,
        4096,
        4096,
        8192,
        8192,
        1 << 20,
    ]


@pytest.mark.parametrize("nbytes", [10.5, -1, True, "64"])
def test_a_size_that_is_not_a_whole_number_of_bytes_is_refused_in_words(nbytes):
    with pytest.raises(GpuflowError, match=f"whole number of bytes, got {nbytes!r}"):
        PinnedPool("cpu", max_bytes=1 << 20).acquire(nbytes)


def test_a_returned_buffer_is_lent_again():
    pool = PinnedPool("cpu", max_bytes=1 << 20)
    first = pool.acquire(5000)
    assert first.capacity == 8192
    storage = first.bytes.data_ptr()
    pool.release(first)
    again = pool.acquire(6000)
    assert again.bytes.data_ptr() == storage
    stats = pool.stats
    assert (stats.hits, stats.misses, stats.bytes_reserved, stats.bytes_in_use) == (
        1,
        1,
        8192,
        8192,
    )


def test_a_buffer_waits_for_its_copy_before_reuse():
    pool = PinnedPool("cpu", max_bytes=1 << 20)
    buf = pool.acquire(4096)
    copy = CopyInFlight()
    pool.release(buf, after=copy)
    other = pool.acquire(4096)  # room under the cap: a new buffer, never the busy one
    assert other.bytes.data_ptr() != buf.bytes.data_ptr()
    assert pool.stats.bytes_in_use == 8192  # the busy one still counts
    copy.done = True
    pool.release(other)
    reused = {pool.acquire(4096).bytes.data_ptr(), pool.acquire(4096).bytes.data_ptr()}
    assert reused == {buf.bytes.data_ptr(), other.bytes.data_ptr()}
    assert pool.stats.misses == 2


def test_at_the_cap_the_pool_waits_for_an_in_flight_copy():
    pool = PinnedPool("cpu", max_bytes=8192)
    a, b = pool.acquire(4096), pool.acquire(4096)
    copy = CopyInFlight()
    pool.release(a, after=copy)
    c = pool.acquire(4096)
    assert copy.waited and c.bytes.data_ptr() == a.bytes.data_ptr()
    assert pool.stats.waits == 1 and pool.stats.high_water_bytes == 8192
    pool.release(b)
    pool.release(c)


def test_at_the_cap_with_nothing_to_wait_for_it_raises_instead_of_hanging():
    pool = PinnedPool("cpu", max_bytes=8192)
    held = [pool.acquire(4096), pool.acquire(4096)]
    with pytest.raises(GpuflowError, match="would wait forever"):
        pool.acquire(4096)
    with pytest.raises(GpuflowError, match="more than the pool's cap"):
        pool.acquire(9000)
    assert pool.stats.bytes_reserved == 8192
    for buf in held:
        pool.release(buf)


def test_idle_buffers_of_another_size_are_evicted_to_make_room():
    pool = PinnedPool("cpu", max_bytes=16384)
    pool.release(pool.acquire(8192))
    big = pool.acquire(16384)
    assert big.capacity == 16384
    stats = pool.stats
    assert (stats.evictions, stats.bytes_reserved) == (1, 16384)


def test_another_thread_releasing_unblocks_a_waiting_acquire():
    pool = PinnedPool("cpu", max_bytes=4096)
    held = pool.acquire(4096)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4096, timeout=None)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: the only buffer is lent out
    pool.release(held)
    waiter.join(timeout=5)
    assert got and got[0].bytes.data_ptr() == held.bytes.data_ptr()
    with pytest.raises(GpuflowError, match=r"no buffer came back within 0\.05 s"):
        pool.acquire(4096, timeout=0.05)  # a wait with a limit: it did not wait forever


def test_releasing_twice_is_an_error():
    pool = PinnedPool("cpu")
    buf = pool.acquire(10)
    pool.release(buf)
    with pytest.raises(GpuflowError, match="already released"):
        pool.release(buf)


def test_a_buffer_goes_back_only_to_the_pool_that_lent_it():
    lender, other = PinnedPool("cpu"), PinnedPool("cpu")
    buf = lender.acquire(10)
    with pytest.raises(GpuflowError, match="lent by another PinnedPool"):
        other.release(buf)
    assert other.stats.bytes_in_use == 0 and lender.stats.bytes_in_use == buf.capacity
    lender.release(buf)
    assert lender.stats.bytes_in_use == 0


def test_releasing_what_is_no_buffer_is_refused_in_words():
    pool = PinnedPool("cpu")
    buf = pool.acquire(10)
    with pytest.raises(
        GpuflowError, match=r"not a tensor \(give the buffer itself, not its .bytes\)"
    ):
        pool.release(buf.bytes)
    with pytest.raises(
        GpuflowError, match="the PinnedBuffer that acquire returned, not a NoneType"
    ):
        pool.release(None)
    pool.release(buf)  # still lent: the refusals changed nothing
    assert pool.stats.bytes_in_use == 0


def test_per_size_retention_cap_unpins_the_extras():
    pool = PinnedPool("cpu", max_cached_per_class=2)
    bufs = [pool.acquire(4096) for _ in range(5)]
    for buf in bufs:
        pool.release(buf)
    stats = pool.stats
    assert (stats.bytes_reserved, stats.bytes_in_use) == (2 * 4096, 0)


def test_close_waits_for_copies_and_frees_everything():
    pool = PinnedPool("cpu", max_bytes=1 << 20)
    copy = CopyInFlight()
    pool.release(pool.acquire(4096), after=copy)
    pool.release(pool.acquire(70000))
    with pool:
        pass
    assert copy.waited
    stats = pool.stats
    assert (stats.bytes_reserved, stats.bytes_in_use) == (0, 0)
    with pytest.raises(GpuflowError, match="closed"):
        pool.acquire(10)


def test_buffer_views_see_the_same_bytes():
    pool = PinnedPool("cpu")
    buf = pool.acquire(64)
    buf.view(torch.float32, (4, 4)).fill_(1.5)
    assert buf.bytes[:4].view(torch.float32).item() == 1.5


def test_a_view_with_minus_one_takes_all_the_buffer_holds():
    buf = PinnedPool("cpu", max_bytes=1 << 16).acquire(4096)
    assert buf.capacity == 4096
    assert buf.view(torch.float32, (-1,)).shape == (1024,)
    assert buf.view(torch.float32, (-1, 4)).shape == (256, 4)
    assert buf.view(torch.float64, (3, -1)).shape == (3, 170)  # what fits, as whole rows
    for shape, said in [((-1, -1), "one -1 at most"), ((0, -1), "beside a size of 0"),
                        ((1025,), "needs 4,100 bytes; this buffer holds 4,096")]:  # fmt: skip
        with pytest.raises(GpuflowError, match=said):
            buf.view(torch.float32, shape)
