"""What a TransferLedger around a training step costs: the tiny preset's GPT step (forward,
backward, AdamW; eager and torch.compile'd), timed with and without a ledger in alternating
rounds, plus one small op for the per-operation cost. Writes JSON.

    python benchmarks/probes/ledger_overhead.py --device auto --out ledger_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT, ModelConfig

TINY = ModelConfig(vocab_size=4096, n_layer=4, n_head=4, d_model=128, max_len=128)
BATCH = 16


def make_step(device: Device, compiled: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = GPT(TINY).to(device.torch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, TINY.vocab_size, (BATCH, TINY.max_len + 1), device=device.torch)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        loss = forward(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def per_step_ms(step: Callable[[], None], device: Device, steps: int, ledger: bool) -> float:
    device.synchronize()
    started = time.perf_counter()
    with TransferLedger(device) if ledger else nullcontext():
        for _ in range(steps):
            step()
        device.synchronize()
    return (time.perf_counter() - started) * 1e3 / steps


def compare(step: Callable[[], None], device: Device, steps: int, rounds: int) -> dict:
    for _ in range(3):  # warm-up: compilation, the allocator's cache, AdamW's state
        step()
    with TransferLedger(device):  # and the ledger's first use (it imports torch._dynamo)
        step()
    plain, counted = [], []
    for _ in range(rounds):  # alternating, so drift hits both alike
        plain.append(per_step_ms(step, device, steps, ledger=False))
        counted.append(per_step_ms(step, device, steps, ledger=True))
    base, under = statistics.median(plain), statistics.median(counted)
    return {
        "step_ms": base,
        "step_ms_under_ledger": under,
        "overhead": under / base - 1,
        "rounds_ms": {"plain": plain, "ledger": counted},
    }


def small_op_us(device: Device, n: int = 20_000) -> dict:
    x = torch.ones(16, device=device.torch)

    def run() -> float:
        started = time.perf_counter()
        for _ in range(n):
            x.add(1)
        device.synchronize()
        return (time.perf_counter() - started) * 1e6 / n

    run()
    base = run()
    with TransferLedger(device):
        run()  # the first region imports torch._dynamo: not the per-op cost
        under = run()
    return {"us": base, "us_under_ledger": under, "ratio": under / base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default="ledger_overhead.json")
    args = parser.parse_args()
    device = Device.resolve(args.device)
    result = {
        "device": str(device),
        "torch": torch.__version__,
        "host": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "model": "tiny preset GPT, batch 16 x 128, AdamW",
        "small_op": small_op_us(device),
        "eager": compare(make_step(device, False), device, args.steps, args.rounds),
    }
    if not args.no_compile:
        result["compiled"] = compare(make_step(device, True), device, args.steps, args.rounds)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
