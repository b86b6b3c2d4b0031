"""How the loader benches time a loop: a loader drained to its last batch's work, two loops
in paired rounds, a training loop's steps after warm-up, and feeds timed alone, with no model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader


def timed_reads(
    device: Device, loader: Iterable[Any], read: Callable[[Any], torch.Tensor] | None
) -> float:
    """Seconds from the first request to the last batch's work done on the device, each
    batch's ``read`` (a device scalar; None: no work at all) summed into an accumulator; the
    loader closed after."""
    acc = torch.zeros((), device=device.torch)
    device.synchronize()
    started = time.perf_counter()
    for batch in loader:
        if read is not None:
            acc += read(batch)
    device.synchronize()
    elapsed = time.perf_counter() - started
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return elapsed


def consume(device: Device, loader: Iterable[torch.Tensor], compute: bool = True) -> float:
    """``timed_reads`` with a little work per batch (one read of it), or none."""
    return timed_reads(device, loader, (lambda b: b.sum()) if compute else None)


def paired_rounds(
    idiom: Callable[[], tuple[float, int]], ours: Callable[[], tuple[float, int]], rounds: int,
    idiom_name: str, unit: str,
) -> dict[str, Any]:  # fmt: skip
    """Both loops ``rounds`` times in pairs, the pair's order alternating (idiom first, then
    ours first: a drift of the host's speed over the run favours neither), after one untimed
    round of each (the process's first round ran apart from the rest: docs/decisions/044);
    each loop returns (seconds, items). Rates per round and their medians, and ``speedup``:
    the median of the pairs' ratios, ours over the idiom's, which compares rounds run side by
    side."""
    rates: dict[str, list[float]] = {idiom_name: [], "deviceloader": []}
    order = [(idiom_name, idiom), ("deviceloader", ours)]
    for _, run in order:
        run()
    for pair in range(rounds):
        for name, run in order if pair % 2 == 0 else order[::-1]:
            seconds, count = run()
            rates[name].append(count / seconds)
    result: dict[str, Any] = {}
    for name, per_round in rates.items():
        result[f"{name}_{unit}_s"] = statistics.median(per_round)
        result[f"{name}_{unit}_s_per_round"] = per_round
    ratios = [a / b for a, b in zip(rates["deviceloader"], rates[idiom_name], strict=True)]
    result["pair_ratios"] = ratios
    result["speedup"] = statistics.median(ratios)
    return result


def timed_steps(
    device: Device, batches: Iterable[Any], step: Callable[[Any], int], warmup: int
) -> tuple[float, int]:
    """(seconds from the end of ``warmup`` steps until the last step's work is done, the
    items ``step`` counted in that time): each batch goes through ``step``."""
    items, started = 0, 0.0
    for i, batch in enumerate(batches):
        if i == warmup:
            device.synchronize()
            started = time.perf_counter()
        counted = step(batch)
        if i >= warmup:
            items += counted
    device.synchronize()
    return time.perf_counter() - started, items


def feed_figures(feed_us: dict[str, float], idiom: str, step_s: float) -> dict[str, Any]:
    """A loop's row fields from its feeds timed alone: the feeds' host us per batch, the
    idiom's step (ms), and DeviceLoader's host time beyond the idiom's as a share of it."""
    step_ms = step_s * 1e3
    extra_ms = (feed_us["deviceloader"] - feed_us[idiom]) / 1e3
    return {"feed_us": feed_us, "step_ms": step_ms, "feed_extra_share": extra_ms / step_ms}


def feed_cost(
    device: Device, feeds: dict[str, Callable[[], Iterable[Any]]],
    first: Callable[[Any], torch.Tensor], batches: int, rounds: int = 5,
) -> dict[str, float]:  # fmt: skip
    """Host microseconds per batch of each feed with no model: ``batches`` batches, each
    read by one small device op on ``first(batch)``, in ``rounds`` rounds in alternating
    order; medians. A loop bound by the host pays its feed's time on top of its step, so
    the difference between two feeds is what one costs a step more than the other, without
    the round-to-round spread of whole training runs."""
    target = device.torch

    def consume(feed: Iterable[Any]) -> float:
        total = torch.zeros((), device=target)
        device.synchronize()
        started = time.perf_counter()
        for batch in feed:
            total += first(batch)
        device.synchronize()
        seconds = time.perf_counter() - started
        if isinstance(feed, DeviceLoader):
            feed.close()
        return seconds / batches * 1e6

    for make in feeds.values():  # untimed warm-up
        consume(make())
    runs: dict[str, list[float]] = {name: [] for name in feeds}
    order = list(feeds.items())
    for round_ in range(rounds):
        for name, make in order if round_ % 2 == 0 else order[::-1]:
            runs[name].append(consume(make()))
    return {name: statistics.median(us) for name, us in runs.items()}
