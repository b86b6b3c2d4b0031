"""``gpuflow bench transfer``'s sections on the cpu at the quick sizes: every size, memory kind
and payload measured, the narrower payloads moving fewer bytes, and memory that stays flat."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from gpuflow.bench.loop_timing import paired_rounds
from gpuflow.bench.transfer import TransferBench, TransferBenchConfig
from gpuflow.bench.workloads import token_batches
from gpuflow.device.accelerator import Device


@pytest.fixture
def bench():
    made = TransferBench(Device("cpu"), TransferBenchConfig.quick())
    yield made
    made.close()


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


def test_token_batches_are_ids_from_the_array_with_targets_one_token_on():
    tokens = np.arange(1000, dtype=np.uint16)  # token i is i: each row is a run
    batches = list(token_batches(tokens, batch=3, context=8, steps=4))
    assert len(batches) == 4
    for inputs, targets in batches:
        assert inputs.shape == targets.shape == (3, 8)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(targets, inputs + 1)
        assert torch.equal(inputs[:, 1:], inputs[:, :-1] + 1)
    again = list(token_batches(tokens, batch=3, context=8, steps=4))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


def test_the_text_loop_trains_through_both_feeds(bench):
    row = bench.text_loop()
    cfg = bench.config.loaders
    assert row["batch_bytes"] == 2 * cfg.text_batch * cfg.text_context * 8
    for name in ("pin_to", "deviceloader"):
        rates = row[f"{name}_tokens_s_per_round"]
        assert len(rates) == cfg.text_rounds and all(rate > 0 for rate in rates)
    ratios = [a / b for a, b in zip(row["deviceloader_tokens_s_per_round"],
                                    row["pin_to_tokens_s_per_round"], strict=True)]  # fmt: skip
    assert row["pair_ratios"] == ratios
    assert row["speedup"] == statistics.median(ratios)
    feed = row["feed_us"]
    assert set(feed) == {"pin_to", "deviceloader", "source_alone"}
    assert all(us > 0 for us in feed.values())
    step_ms = 1e3 * cfg.text_batch * cfg.text_context / row["pin_to_tokens_s"]
    assert row["step_ms"] == pytest.approx(step_ms)
    extra = (feed["deviceloader"] - feed["pin_to"]) / 1e3 / step_ms
    assert row["feed_extra_share"] == pytest.approx(extra)


def test_the_image_loop_trains_through_both_feeds_and_times_the_feeds_alone(bench):
    cfg = bench.config.loaders
    (row,) = bench.image_loop()
    assert row["batch_size"] == cfg.image_batch_sizes[0]
    for name in ("dataloader", "deviceloader"):
        rates = row[f"{name}_images_s_per_round"]
        assert len(rates) == cfg.image_rounds and all(rate > 0 for rate in rates)
    feed = row["feed_us"]
    assert set(feed) == {"dataloader", "deviceloader", "source_alone"}
    assert all(us > 0 for us in feed.values())
    step_ms = 1e3 * row["batch_size"] / row["dataloader_images_s"]
    assert row["step_ms"] == pytest.approx(step_ms)
    extra = (feed["deviceloader"] - feed["dataloader"]) / 1e3 / step_ms
    assert row["feed_extra_share"] == pytest.approx(extra)


def test_paired_rounds_warm_both_up_then_alternate_which_goes_first_and_compare_pairs():
    calls = []
    # items per second, in call order: the first two are the untimed rounds
    speeds = iter([500.0, 700.0, 100.0, 90.0, 80.0, 120.0, 50.0, 60.0])

    def loop(name):
        def run():
            calls.append(name)
            return 1.0, next(speeds)

        return run

    result = paired_rounds(loop("idiom"), loop("ours"), 3, "pin_to", "tokens")
    assert calls == ["idiom", "ours", "idiom", "ours", "ours", "idiom", "idiom", "ours"]
    assert result["pin_to_tokens_s_per_round"] == [100.0, 120.0, 50.0]
    assert result["deviceloader_tokens_s_per_round"] == [90.0, 80.0, 60.0]
    assert result["pair_ratios"] == [0.9, 80.0 / 120.0, 1.2]
    assert result["speedup"] == 0.9
    assert result["pin_to_tokens_s"] == 100.0 and result["deviceloader_tokens_s"] == 80.0
