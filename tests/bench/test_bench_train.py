"""``gpuflow bench train`` on the cpu: a row per data path and the synthetic-batch reference,
the ratios between them, and the bus figures of each path from the ledger."""

from __future__ import annotations

import statistics

import pytest

from gpuflow.bench.train import (
    LEDGER_PAIRS,
    MODES,
    TrainBenchConfig,
    print_train_table,
    run_train_bench,
)
from gpuflow.device.accelerator import Device
from tests.helpers import FAST


def test_every_path_gets_a_row_with_its_ratios_and_bus_figures(prepared, capsys):
    assert MODES == ("naive", "standard", "streamed", "resident", "resident-graph")
    bench = TrainBenchConfig(
        preset="tiny",
        modes=("standard", "streamed", "resident-graph"),
        warmup=1,
        timed=2,
        overrides=(*FAST, f"data.dir={prepared}"),
    )
    result = run_train_bench(Device("cpu"), bench)
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == ["standard", "streamed", "resident (synthetic batch)"]
    assert result["skipped"] == {
        "resident-graph": "resident-graph needs CUDA graphs; running resident eagerly on cpu"
    }
    assert (result["batch_size"], result["seq_len"]) == (8, 32)
    assert all(row["tokens_per_s"] > 0 and row["step_ms"] > 0 for row in rows.values())
    assert rows["standard"]["vs_standard"] == 1.0
    assert rows["streamed"]["vs_standard"] == pytest.approx(
        rows["streamed"]["tokens_per_s"] / rows["standard"]["tokens_per_s"]
    )
    # streamed moves its uint16 ids through the loader: 2 bytes per token of a (8, 33) batch
    assert rows["streamed"]["h2d_bytes_per_step"] == 8 * 33 * 2
    assert rows["streamed"]["syncs_per_step"] == 0
    assert "data_path_overhead" in rows["standard"]  # against the synthetic batch
    for row in rows.values():  # intervals under the ledger, each beside one without it
        ratios = row["ledger_pair_ratios"]
        assert len(ratios) == LEDGER_PAIRS and row["ledger_step_ms"] > 0
        assert row["ledger_cost"] == pytest.approx(statistics.median(ratios) - 1)
        assert min(ratios) <= row["ledger_step_ms"] / row["unledgered_step_ms"] <= max(ratios)
    print_train_table(result)
    out = capsys.readouterr().out
    assert "standard" in out and "streamed" in out and "bus traffic per step" in out
    assert "ledger cost" in out
