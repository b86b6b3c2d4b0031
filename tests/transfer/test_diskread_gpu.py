"""data.io on CUDA: kvikio, gpuflow's pinned reads and memmap + .to() put the same corpus on
the device; a kvikio-read corpus shows as disk-to-device bytes, not host-to-device; training
reads the same batches either way."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import gpuflow
from gpuflow.data.resident.tokens import ResidentTokens
from gpuflow.interface.cli.main import main
from gpuflow.transfer import diskread
from tests.helpers import random_shards, tiny_runs

pytestmark = pytest.mark.gpu


@pytest.fixture
def kvikio(accel):
    if accel.type != "cuda":
        pytest.skip("kvikio reads into CUDA memory")
    if diskread.kvikio_mode() is None:
        pytest.skip(f"kvikio is not installed: {diskread.install_hint()}")


def _shards(folder, dtype, sizes=(3_000_001, 1_700_003, 26_000_007)):
    return random_shards(folder, sizes, dtype, 100_000 if dtype == np.uint32 else 65_536, seed=1)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_every_path_puts_the_same_corpus_on_the_device(accel, kvikio, tmp_path, dtype):
    shards = _shards(tmp_path, dtype)
    with warnings.catch_warnings():  # read-only maps; .to() only reads them
        warnings.simplefilter("ignore", UserWarning)
        memmap = torch.cat([torch.from_numpy(np.asarray(s.tokens)).to(accel.torch) for s in shards])
    expected = memmap.view(torch.int16 if dtype == np.uint16 else torch.int32)
    for world_size in (1, 2):
        for rank in range(world_size):
            held = {}
            for io in ("pinned", "kvikio"):
                tokens = ResidentTokens(
                    shards, accel, 8, 64, rank=rank, world_size=world_size, vocab_size=1 << 17,
                    io=io,
                )  # fmt: skip
                held[io] = tokens._active.clone()
                first = tokens._first
                tokens.close()
            assert torch.equal(held["kvikio"], held["pinned"])
            assert torch.equal(held["kvikio"], expected[first : first + held["kvikio"].numel()])


def test_a_streamed_corpus_switches_chunks_through_kvikio(accel, kvikio, tmp_path):
    shards = _shards(tmp_path, np.uint16)
    built = {
        io: ResidentTokens(shards, accel, 8, 64, budget_bytes=24 << 20, io=io)
        for io in ("pinned", "kvikio")
    }
    assert built["kvikio"].n_chunks > 3
    steps = built["kvikio"].steps_per_chunk * 4  # through several switches, staged each time
    for step in range(steps):
        batches = []
        for tokens in built.values():
            tokens.advance(step)
            batches.append(tokens.sample()[0])
        assert torch.equal(*batches)
    for tokens in built.values():
        tokens.close()


def test_the_ledger_counts_kvikio_reads_as_disk_to_device(accel, kvikio, tmp_path):
    shards = _shards(tmp_path, np.uint16)
    nbytes = sum(2 * s.n_tokens for s in shards)
    totals = {}
    for io in ("pinned", "kvikio"):
        with gpuflow.TransferLedger(device=accel) as ledger:
            ResidentTokens(shards, accel, 8, 64, vocab_size=1 << 16, io=io).close()
        totals[io] = ledger.summary().totals
    assert (totals["kvikio"].disk2d_bytes, totals["kvikio"].h2d_bytes) == (nbytes, 0)
    assert (totals["pinned"].disk2d_bytes, totals["pinned"].h2d_bytes) == (0, nbytes)


def test_training_reads_the_same_batches_through_kvikio(accel, kvikio, prepared, workdir):
    runs = tiny_runs(accel, prepared, workdir, "data.io", ("pinned", "kvikio"))
    (pinned, by_pinned), (kvikio, by_kvikio) = runs["pinned"], runs["kvikio"]
    assert (by_pinned.data_io.path, by_kvikio.data_io.path) == ("pinned", "kvikio")
    assert len(kvikio) == 20 and kvikio == pinned


def test_bench_io_measures_every_path_and_cleans_up(accel, workdir):
    if accel.type != "cuda":
        pytest.skip("bench io reads into CUDA memory")
    out = workdir / "results"
    assert main(["bench", "io", "--mib", "64", "--repeats", "1", "--out", str(out)]) == 0
    (path,) = out.glob("*-io-generated-*.json")
    record = json.loads(path.read_text())
    paths = [row["path"] for row in record["rows"]]
    expected = ["pinned", "auto", "memmap + .to()"]
    assert paths == (["kvikio", *expected] if diskread.kvikio_mode() else expected)
    assert record["corpus_bytes"] == 64 << 20 and record["identical_bytes"]
    for row in record["rows"]:
        assert row["cold"]["gb_per_s"] > 0 and row["warm"]["gb_per_s"] > 0
    assert [p.name for p in out.iterdir()] == [path.name]  # the generated shards are gone
