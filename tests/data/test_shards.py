"""Token shards: our writer, llm.c's header, and every way a shard can be wrong."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gpuflow.common.atomic import write_atomic
from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import HEADER_BYTES, Shard, ShardWriter, token_dtype_for, write_shard


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.one_of(
        hnp.arrays(np.uint16, st.integers(0, 3000)),
        hnp.arrays(np.uint32, st.integers(0, 3000)),
    )
)
def test_write_then_open_round_trips(tmp_path_factory, tokens):
    path = tmp_path_factory.mktemp("shard") / "s.bin"
    write_shard(path, tokens)
    shard = Shard.open(path)
    assert shard.n_tokens == tokens.size
    assert shard.dtype == tokens.dtype
    np.testing.assert_array_equal(shard.tokens, tokens)
    assert path.stat().st_size == HEADER_BYTES + tokens.nbytes


def _llmc_shard(path, tokens: np.ndarray, magic: int, version: int) -> None:
    """Byte-for-byte what llm.c's dev/data/data_common.py write_datafile produces."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


def test_llmc_gpt2_shard_loads_unchanged(tmp_path):
    tokens = np.array([50256, 464, 2068, 7586, 21831, 50256, 0, 65535], dtype=np.uint16)
    path = tmp_path / "fineweb_val_000000.bin"
    _llmc_shard(path, tokens, magic=20240520, version=1)
    shard = Shard.open(path)
    assert shard.dtype == np.uint16
    np.testing.assert_array_equal(shard.tokens, tokens)
    assert shard.max_token() == 65535


def test_llmc_llama3_uint32_shard_loads_unchanged(tmp_path):
    tokens = np.array([128000, 791, 4062, 128001, 70000], dtype=np.uint32)
    path = tmp_path / "llama_train_000001.bin"
    _llmc_shard(path, tokens, magic=20240801, version=7)
    shard = Shard.open(path)
    assert shard.dtype == np.uint32
    np.testing.assert_array_equal(shard.tokens, tokens)


def test_token_dtype_picks_the_narrowest_format():
    assert token_dtype_for(65536) == np.uint16
    assert token_dtype_for(65537) == np.uint32


@pytest.mark.parametrize(
    ("magic", "version", "message"),
    [(12345, 1, "not a token shard"), (20240520, 7, "version 7"), (20240801, 1, "version 1")],
)
def test_wrong_magic_or_version_is_refused(tmp_path, magic, version, message):
    path = tmp_path / "bad.bin"
    _llmc_shard(path, np.arange(10, dtype=np.uint16), magic, version)
    with pytest.raises(GpuflowError, match=message):
        Shard.open(path)


def test_truncated_body_and_header_are_refused(tmp_path):
    path = tmp_path / "cut.bin"
    write_shard(path, np.arange(100, dtype=np.uint16))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(GpuflowError, match="truncated"):
        Shard.open(path)
    path.write_bytes(data[:100])
    with pytest.raises(GpuflowError, match="truncated"):
        Shard.open(path)
    path.write_bytes(data + b"\x00\x00")
    with pytest.raises(GpuflowError, match="longer than its header"):
        Shard.open(path)


def test_writer_streams_shards_closed_where_the_caller_finishes_them(tmp_path):
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=1024)
    stream = np.arange(2500, dtype=np.uint16)
    for start in range(0, 2500, 300):  # pieces of 300: a shard closes once one fills it
        writer.add(stream[start : start + 300])
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("train")) == [
            p.name for p in writer.paths
        ]  # the open shard is a hidden temporary until finished
        if writer.full:
            writer.finish()
    paths = writer.close()
    assert [p.name for p in paths] == ["train_000000.bin", "train_000001.bin", "train_000002.bin"]
    assert [Shard.open(p).n_tokens for p in paths] == [1200, 1200, 100]
    np.testing.assert_array_equal(np.concatenate([Shard.open(p).tokens for p in paths]), stream)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]


def test_the_tail_comes_from_the_open_shard_or_else_the_last_finished_one(tmp_path):
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=10)
    writer.add(np.arange(12, dtype=np.uint16))
    writer.finish()
    writer.add(np.arange(12, 15, dtype=np.uint16))
    np.testing.assert_array_equal(writer.take_tail(5), [12, 13, 14])  # the open shard's, all
    np.testing.assert_array_equal(writer.take_tail(4), [8, 9, 10, 11])  # then the last shard's
    (path,) = writer.close()
    np.testing.assert_array_equal(Shard.open(path).tokens, np.arange(8))
    assert writer.total_tokens == 8 and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.arange(10, dtype=np.uint16))
    before = path.read_bytes()

    def chunks():
        yield b"partial data"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, chunks())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
