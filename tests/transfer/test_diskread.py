"""data.io on the cpu: the choice and its fallback chain, and kvikio's read path.

kvikio cannot load without CUDA's driver, so the tests of the read path hand the reader a
stand-in module that keeps kvikio's contract (``CuFile(path).pread(buffer, size, offset)``
returns a future whose ``get()`` is the byte count) with POSIX reads: they check gpuflow's
own offsets, request split, id checks and accounting. The real kvikio reads the same shards
in ``tests/transfer/test_diskread_gpu.py``; the test below that imports it skips with the reason.
"""

from __future__ import annotations

import os
import threading
import types
from typing import ClassVar

import numpy as np
import pytest
import torch

import gpuflow
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.tokens import ResidentTokens
from gpuflow.data.shards import HEADER_BYTES, write_shard
from gpuflow.device.accelerator import Device
from gpuflow.train.config import DataConfig
from gpuflow.transfer import diskread
from tests.helpers import random_shards

B, T = 4, 16
CUDA = Device("cuda", 0)  # never touched: choose_io only reads its type


class _Future:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _PosixFile:
    """kvikio.CuFile's read contract, by os.pread into the tensor's host memory."""

    requests: ClassVar[list[tuple[int, int]]] = []  # (file offset, size) of every pread

    def __init__(self, path: str, flags: str = "r") -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def pread(self, buffer: torch.Tensor, size: int, file_offset: int) -> _Future:
        _PosixFile.requests.append((file_offset, size))
        data = os.pread(self.fd, size, file_offset)
        buffer.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return _Future(len(data))

    def close(self) -> None:
        os.close(self.fd)


def _stand_in(compat: bool = True) -> types.SimpleNamespace:
    settings = {"num_threads": 1}  # kvikio's default
    defaults = types.SimpleNamespace(
        is_compat_mode_preferred=lambda: compat, get=settings.get, set=settings.__setitem__
    )
    return types.SimpleNamespace(CuFile=_PosixFile, defaults=defaults)


@pytest.fixture
def posix_kvikio(monkeypatch):
    _PosixFile.requests = []
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    stand_in = _stand_in()
    monkeypatch.setattr(diskread, "_load_kvikio", lambda: stand_in)
    return stand_in


@pytest.fixture
def no_kvikio(monkeypatch):
    monkeypatch.setattr(diskread, "_load_kvikio", lambda: None)


def _shards(tmp_path, sizes=(3000, 1700, 2600), dtype=np.uint16, high=60000):
    return random_shards(tmp_path, sizes, dtype, high)


# ---- the choice -----------------------------------------------------------------------------


def test_data_io_is_validated():
    assert DataConfig(io="kvikio").io == "kvikio"
    with pytest.raises(GpuflowError, match=r"data\.io must be one of auto, kvikio, pinned"):
        DataConfig(io="gds")


def test_pinned_is_taken_as_asked(posix_kvikio):
    assert diskread.choose_io("pinned", CUDA) == diskread.IoChoice("pinned", None, "as configured")


def test_auto_takes_kvikio_and_says_its_mode(posix_kvikio, monkeypatch):
    choice = diskread.choose_io("auto", CUDA)
    assert (choice.path, choice.mode) == ("kvikio", "compat")
    assert "no GPUDirect Storage" in choice.reason
    assert choice.describe().startswith("data.io kvikio (compat): ")
    monkeypatch.setattr(diskread, "_load_kvikio", lambda: _stand_in(compat=False))
    assert diskread.choose_io("auto", CUDA).mode == "gds"


@pytest.mark.parametrize(
    "device, managed, why",
    [
        (Device("cpu"), False, "kvikio reads into CUDA memory, and the device is cpu"),
        (CUDA, True, "managed memory"),
    ],
)
def test_auto_falls_back_to_pinned_and_kvikio_is_refused(posix_kvikio, device, managed, why):
    choice = diskread.choose_io("auto", device, managed)
    assert choice.path == "pinned" and why in choice.reason
    with pytest.raises(GpuflowError, match=r"data\.io=kvikio cannot run: .*set data\.io=pinned"):
        diskread.choose_io("kvikio", device, managed)


def test_without_kvikio_auto_reads_pinned_and_names_the_extra(no_kvikio, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    choice = diskread.choose_io("auto", CUDA)
    assert choice.path == "pinned"
    assert "kvikio is not installed: pip install 'gpuflow[gds]'" in choice.reason
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(GpuflowError, match=r"gpuflow\[gds-cu12\]"):
        diskread.choose_io("kvikio", CUDA)
    with pytest.raises(GpuflowError, match="kvikio is not installed"):
        diskread.KvikioReader(CUDA)


def test_the_real_kvikio_when_it_loads(tmp_path):
    if diskread._import_kvikio() is None:
        pytest.skip("kvikio is not installed or cannot load here (it needs CUDA's driver)")
    (shard,) = _shards(tmp_path, sizes=(5000,))
    target = torch.empty(shard.n_tokens, dtype=torch.int16)
    diskread.KvikioReader(Device("cpu")).read(shard.path, HEADER_BYTES, target)
    assert np.array_equal(target.numpy().view(np.uint16), np.asarray(shard.tokens))


# ---- the read path, through the stand-in ----------------------------------------------------


def test_reads_start_page_aligned_after_a_short_head(posix_kvikio, tmp_path):
    (shard,) = _shards(tmp_path, sizes=(9000,))
    reader = diskread.KvikioReader(Device("cpu"))
    target = torch.empty(8000, dtype=torch.int16)  # (n,)
    offset = HEADER_BYTES + 2 * 500  # tokens 500..8500
    with gpuflow.TransferLedger() as ledger:
        reader.read(shard.path, offset, target)
    assert np.array_equal(target.numpy().view(np.uint16), np.asarray(shard.tokens[500:8500]))
    assert _PosixFile.requests == [(offset, 4096 - offset), (4096, 16000 - (4096 - offset))]
    totals = ledger.summary().totals
    assert (totals.disk2d_bytes, totals.disk2d_copies, totals.h2d_bytes) == (16000, 1, 0)
    reader.close()


def test_kvikio_reads_on_several_threads_unless_told(posix_kvikio, monkeypatch):
    choice = diskread.choose_io("auto", CUDA)
    assert posix_kvikio.defaults.get("num_threads") == diskread.READ_THREADS
    assert f"on {diskread.READ_THREADS} thread(s)" in choice.reason
    posix_kvikio.defaults.set("num_threads", 3)
    monkeypatch.setenv("KVIKIO_NTHREADS", "3")
    diskread.KvikioReader(Device("cpu"))
    assert posix_kvikio.defaults.get("num_threads") == 3


def test_host_reads_on_threads_fill_the_buffer_and_refuse_a_short_file(tmp_path, monkeypatch):
    monkeypatch.setattr(diskread, "_READ_PART", 4096)  # many parts, on several threads
    path = tmp_path / "bytes"
    data = np.random.default_rng(0).integers(0, 256, size=100_000, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    reader = diskread.HostFileReader(threads=4)
    out = np.empty(90_001, dtype=np.uint8)
    reader.read(path, 777, out)
    assert np.array_equal(out, data[777 : 777 + 90_001])
    with pytest.raises(GpuflowError, match="gave 10000 of 20000 bytes"):
        reader.read(path, 90_000, np.empty(20_000, dtype=np.uint8))
    # Many short reads at once (a chunk of pieces): each lands where asked, and a short one
    # is named by its own offset.
    outs = [np.empty(n, dtype=np.uint8) for n in (10, 5000, 9000, 1)]
    offsets = (99_990, 3, 40_000, 0)
    reader.read_many(zip([path] * 4, offsets, outs, strict=True))
    for offset, out in zip(offsets, outs, strict=True):
        assert np.array_equal(out, data[offset : offset + out.size])
    with pytest.raises(GpuflowError, match="gave 500 of 1000 bytes from offset 99500"):
        reader.read_many([(path, 0, outs[1]), (path, 99_500, np.empty(1000, dtype=np.uint8))])
    reader.close()


def test_a_short_file_is_an_error(posix_kvikio, tmp_path):
    (shard,) = _shards(tmp_path, sizes=(100,))
    target = torch.empty(200, dtype=torch.int16)
    with pytest.raises(GpuflowError, match="gave 200 of 400 bytes"):
        diskread.KvikioReader(Device("cpu")).read(shard.path, HEADER_BYTES, target)


def test_a_budget_limits_disk_reads(posix_kvikio, tmp_path):
    (shard,) = _shards(tmp_path, sizes=(100,))
    target = torch.empty(100, dtype=torch.int16)
    over = pytest.raises(gpuflow.BudgetExceeded, match="disk2d_bytes: 200 > 0")
    with over, gpuflow.budget(disk2d_bytes=0, device="cpu"):
        diskread.KvikioReader(Device("cpu")).read(shard.path, HEADER_BYTES, target)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("world_size, budget", [(1, None), (2, None), (1, 6000)])
def test_both_paths_hold_the_same_corpus(posix_kvikio, tmp_path, dtype, world_size, budget):
    """Whole, per rank, and streamed in chunks: every chunk the same through either path."""
    shards = _shards(tmp_path, dtype=dtype, high=70000 if dtype == np.uint32 else 60000)
    for rank in range(world_size):
        built = {
            io: ResidentTokens(
                shards,
                "cpu",
                B,
                T,
                rank=rank,
                world_size=world_size,
                budget_bytes=budget,
                vocab_size=80000,
                io=io,
            )
            for io in ("pinned", "kvikio")
        }
        pinned, kvikio = built["pinned"], built["kvikio"]
        assert pinned.n_chunks == kvikio.n_chunks and (budget is None) == (pinned.n_chunks == 1)
        for chunk in range(pinned.n_chunks):
            for tokens in built.values():
                tokens._upload(chunk, tokens._active)
            held = sum(n for _, n in pinned._spans(chunk))  # a chunk may not fill the buffer
            assert torch.equal(pinned._active[:held], kvikio._active[:held])
        for step in range(3 * pinned.steps_per_chunk):  # the streamed switches agree too
            for tokens in built.values():
                tokens.advance(step)
            assert torch.equal(pinned.sample()[0], kvikio.sample()[0])
        for tokens in built.values():
            tokens.close()


@pytest.mark.parametrize("io", ["pinned", "kvikio"])
@pytest.mark.parametrize("dtype, bad", [(np.uint16, 65535), (np.uint32, 3_000_000_000)])
def test_either_path_checks_ids_as_unsigned(posix_kvikio, tmp_path, io, dtype, bad):
    shards = _shards(tmp_path, dtype=dtype)
    body = np.asarray(shards[1].tokens).copy()
    body[17] = bad  # negative in the signed view the corpus is held in
    write_shard(shards[1].path, body)
    threads = threading.active_count()
    with pytest.raises(GpuflowError, match=f"{shards[1].path.name}.*{bad}"):
        ResidentTokens(shards, "cpu", B, T, vocab_size=60000, io=io)
    assert threading.active_count() == threads  # the refused corpus's readers are gone


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_resident_tokens_dropped_without_close_close_their_files(tmp_path):
    """Each reader kept one open file per shard until close(), which a dropped one never
    had: 200 made and dropped held 200 files open."""
    import gc

    shards = _shards(tmp_path)

    def open_files() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    ResidentTokens(shards, "cpu", 2, 8, io="pinned", show_progress=False).close()
    before = open_files()
    for _ in range(20):
        tokens = ResidentTokens(shards, "cpu", 2, 8, io="pinned", show_progress=False)
        tokens.sample()
        del tokens
    assert open_files() <= before
