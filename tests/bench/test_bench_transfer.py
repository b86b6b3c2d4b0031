"""``gpuflow bench transfer``'s sections on the cpu at the quick sizes: every size, memory kind
and payload measured, the narrower payloads moving fewer bytes, and memory that stays flat."""

from __future__ import annotations

import pytest

from gpuflow.bench.transfer import TransferBench, TransferBenchConfig
from gpuflow.device.accelerator import Device


@pytest.fixture
def bench():
    made = TransferBench(Device("cpu"), TransferBenchConfig.quick())
    yield made
    made.close()


def test_quick_is_the_full_bench_at_smaller_sizes():
    quick, full = TransferBenchConfig.quick(), TransferBenchConfig()
    assert max(quick.sizes) < max(full.sizes)
    assert quick.flat_iterations < full.flat_iterations
    assert quick.payload_bytes < full.payload_bytes


def test_each_size_is_timed_both_ways_from_each_kind_of_memory(bench):
    rows = bench.memory_kinds()
    kinds = {(r["direction"], r["memory"], r["bytes"]) for r in rows}
    for direction in ("h2d", "d2h"):
        for memory in ("pageable", "fresh_pinned", "pooled"):
            for size in bench.config.sizes:
                assert (direction, memory, size) in kinds
    assert all(r["ms"] > 0 and r["gb_s"] > 0 for r in rows)


def test_narrower_payloads_cross_in_fewer_bytes_than_fp32(bench):
    rows = {r["payload"]: r for r in bench.payloads()}
    logical = bench.config.payload_bytes
    assert rows["fp32"]["wire_bytes"] == logical
    assert rows["bf16"]["wire_bytes"] == logical // 2
    assert rows["uint8"]["wire_bytes"] == logical // 4
    assert all(r["logical_bytes"] == logical for r in rows.values())
    assert rows["fp32"]["vs_fp32"] == 1.0


def test_many_small_tensors_are_timed_separately_packed_and_in_bulk(bench):
    result = bench.small_tensors()
    assert (result["tensors"], result["bytes_each"]) == (200, 4096)
    for key in ("separate_pageable_ms", "separate_pinned_ms", "packed_ms", "bulk_ms"):
        assert result[key] > 0


def test_the_pinned_pool_stays_flat_over_iterations_and_epochs(bench):
    result = bench.flat_memory()
    assert result["iterations"] == bench.config.flat_iterations
    assert result["flat"] is True
    assert result["after_100"] == result[f"after_{bench.config.flat_iterations}"]
