"""``gpuflow bench checkpoint`` on the cpu with a tiny model: a stall for each way of saving,
figures that add up, and no scratch left behind."""

from __future__ import annotations

import tempfile

from gpuflow.bench.checkpoint import (
    KINDS,
    CheckpointBenchConfig,
    print_checkpoint_table,
    run_checkpoint_bench,
)
from gpuflow.device.accelerator import Device
from tests.helpers import FAST


def test_each_kind_of_save_gets_a_stall_and_the_scratch_is_removed(
    prepared, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the bench's scratch goes
    bench = CheckpointBenchConfig(
        preset="tiny", warmup=1, window=2, rounds=1, overrides=(*FAST, f"data.dir={prepared}")
    )
    result = run_checkpoint_bench(Device("cpu"), bench)
    assert list(tmp_path.iterdir()) == []
    assert [row["kind"] for row in result["rows"]] == list(KINDS)
    assert all(len(row["stall_ms_rounds"]) == 1 for row in result["rows"])
    assert result["data_path"] == "resident" and result["tokens_per_step"] == 8 * 32
    # the files hold every tensor of the state, and a little more (their headers)
    assert result["state_bytes"] < result["file_bytes"] < result["state_bytes"] * 1.1
    assert result["step_ms"] > 0 and result["async_write_s"] > 0
    print_checkpoint_table(result)
    out = capsys.readouterr().out
    assert all(kind in out for kind in KINDS) and "while training went on" in out
