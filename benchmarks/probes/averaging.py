"""Probe: what averaging the gradients over ranks costs the captured step, one NCCL rank
(world size 1) in this process, A/B against the single-process step.

single: no process group, no all-reduce (plain ``gpuflow train``);
copyback: the first averager: per dtype a fresh flat copy of the gradients (and the fp32
loss with the fp32 ones), all-reduce (sum), a scale by 1 / world size, copied back;
flat: ``GradientAverager``: gradients copied into a persistent flat buffer, all-reduce
(average), each ``.grad`` then a view of it; the loss reduced on its own;
flat-noloss: flat without the loss's all-reduce (what the second NCCL call costs);
copyonly: flat without any all-reduce (what the copy into the flat buffer costs);
coalesced: no copies: one NCCL group of in-place all-reduces (average), one per gradient
where autograd left them; the loss on its own.

PYTHONPATH=src python3 benchmarks/probes/averaging.py PRESET OUT.json [rounds] [variants]
"""

import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpuflow.device.accelerator import Device
from gpuflow.train import distributed
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import GradientAverager, Ranks
from gpuflow.train.loop import run_steps
from gpuflow.train.trainer import Trainer


class CopyBack:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.bytes_per_step = world_size, 0

    def __call__(self, params, loss=None):
        tensors = [p.grad for p in params] + ([] if loss is None else [loss])
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat)
            flat.mul_(1.0 / self.world_size)
            torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))
        return [p.grad for p in params]


class NoLoss(GradientAverager):
    def __call__(self, params, loss=None):
        return super().__call__(params, None)


class CopyOnly(GradientAverager):
    def _mean(self, tensor):
        pass


class Coalesced:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.bytes_per_step = world_size, 0

    def __call__(self, params, loss=None):
        grads = [p.grad for p in params]
        with dist._coalescing_manager(device=grads[0].device):  # one dtype per group
            for t in grads:
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if loss is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        self.bytes_per_step = sum(t.numel() * t.element_size() for t in grads)
        return grads


AVERAGERS = {
    "copyback": CopyBack,
    "flat": GradientAverager,
    "flat-noloss": NoLoss,
    "copyonly": CopyOnly,
    "coalesced": Coalesced,
}


def measure(config, device, label, run_dir, warmup=10, timed=100):
    ranks = None if label == "single" else Ranks(0, 1, 0, launched=True)
    trainer = Trainer(config, run_dir, device, ranks=ranks)
    trainer.build(resume=False, say=lambda note: None)
    if ranks is not None:  # the step is opened below, with this averager
        trainer.setup = dataclasses.replace(trainer.setup, averager=AVERAGERS[label](1))
    total = warmup + timed
    with trainer.open_step(0, total) as step:
        run_steps(step, 0, warmup)
        device.synchronize()
        started = time.perf_counter()
        run_steps(step, warmup, total)
        device.synchronize()
        seconds = time.perf_counter() - started
        step.scalars.drain(total)
    averager = trainer.setup.averager
    return {
        "variant": label,
        "tokens_per_s": timed * trainer.tokens_per_step / seconds,
        "step_ms": seconds * 1e3 / timed,
        "allreduce_bytes_per_step": averager.bytes_per_step if averager else 0,
    }


preset, out = sys.argv[1], Path(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else ["single", "copyback", "flat"]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
device = Device.resolve("cuda")
distributed.start(Ranks(0, 1, 0, launched=True), device)
config = resolve_config(preset, None, ["train.steps=200"])
rows = []
with tempfile.TemporaryDirectory() as scratch:
    for r in range(rounds):
        for label in chosen:
            row = measure(config, device, label, Path(scratch) / f"{label}{r}")
            row["round"] = r
            rows.append(row)
            print(
                f"{preset} {label:12s} round {r}: {row['tokens_per_s']:,.0f} tok/s "
                f"{row['step_ms']:.3f} ms/step",
                flush=True,
            )
            out.write_text(json.dumps({"preset": preset, "rows": rows}, indent=1))
distributed.stop()
