"""``gpuflow bench io`` on CUDA, at 8 MiB of generated shards: every path puts the same bytes on
the device, each timed cold and warm, and the shards are removed after."""

from __future__ import annotations

import pytest

from gpuflow.bench.io import MEMMAP, IoBenchConfig, print_io_table, run_io_bench

pytestmark = pytest.mark.gpu


def test_every_path_reads_the_same_corpus_cold_and_warm(accel, tmp_path, capsys):
    if accel.type != "cuda":
        pytest.skip(f"bench io reads into CUDA memory; this accelerator is {accel.type}")
    result = run_io_bench(accel, IoBenchConfig(mib=8, repeats=1, scratch=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # the generated shards are gone
    assert result["corpus_bytes"] == 8 << 20 and result["identical_bytes"]
    paths = [row["path"] for row in result["rows"]]
    assert {"pinned", "auto", MEMMAP} <= set(paths)
    for row in result["rows"]:
        assert row["cold"]["gb_per_s"] > 0 and row["warm"]["gb_per_s"] > 0
    print_io_table(result)
    assert "auto takes" in capsys.readouterr().out
