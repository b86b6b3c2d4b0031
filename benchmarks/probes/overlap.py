"""Probe: the captured step on two GPUs with its all-reduce after the backward (``flat``:
one flat buffer, the whole model compiled) against bucket by bucket during the backward
(``overlap``: the model compiled region by region, ``gpuflow.train.overlap``), beside each
rank training alone (``single``: no collectives, what plain ``gpuflow train`` runs); A/B in
one pair of processes, rounds alternating. After each data-parallel variant the ranks'
weights are compared bit for bit.

    torchrun --standalone --nproc_per_node=2 benchmarks/probes/overlap.py PRESET OUT.json \
        [rounds] [variants] [PROFILE.txt]

``regional-flat``: the model compiled region by region, all-reduced after the backward (what
the regions' compile costs alone). PROFILE.txt: rank 0's CUDA kernel table of 20 steps of each
variant in the first round.
"""

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from gpuflow.train import distributed
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import Ranks
from gpuflow.train.overlap import RegionalForward
from gpuflow.train.step import StepOptions
from gpuflow.train.trainer import Trainer, open_training_data


def weights_digest(trainer: Trainer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def measure(config, device, ranks, label, run_dir, warmup=10, timed=200, profile=None):
    options = StepOptions(overlap_allreduce=label == "overlap")
    job = None if label == "single" else ranks
    trainer = Trainer(config, run_dir, device, options=options, ranks=job)
    trainer.build(resume=False, say=lambda note: None)
    if label == "regional-flat":  # the regions' compile alone: all-reduce after the backward
        torch._dynamo.reset()
        trainer.forward = RegionalForward(trainer.model, None, trainer.options.compile_options)
    total = warmup + timed
    with trainer.open_step(0, total) as step:
        for s in range(warmup):
            step.run(s)
        device.synchronize()
        started = time.perf_counter()
        for s in range(warmup, total):
            step.run(s)
        device.synchronize()
        seconds = time.perf_counter() - started
        if profile is not None:
            with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
                for s in range(total, total + 20):
                    step(s)
                device.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            profile.write_text(profile.read_text() + f"\n# {label}, 20 steps\n{table}\n")
        losses = [m["loss"] for _, m in step.scalars.drain(total)]
    row = {
        "variant": label,
        "rank": ranks.rank,
        "tokens_per_s": timed * trainer.tokens_per_step / seconds,  # the job's
        "step_ms": seconds * 1e3 / timed,
        "last_loss": losses[-1] if losses else None,
        "allreduce_bytes_per_step": trainer.averager.bytes_per_step if trainer.averager else 0,
    }
    if job is not None:
        digests = [None] * ranks.world_size
        dist.all_gather_object(digests, weights_digest(trainer))
        row["ranks_identical"] = len(set(digests)) == 1
    return row


preset, out = sys.argv[1], Path(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
variants = sys.argv[4].split(",") if len(sys.argv) > 4 else ["single", "flat", "overlap"]
profile = Path(sys.argv[5]) if len(sys.argv) > 5 else None  # rank 0's kernel tables
if profile is not None:
    profile.write_text("")
ranks = Ranks.from_env()
device = distributed.rank_device(ranks, "cuda")
distributed.start(ranks, device)
config = resolve_config(preset, None, ["train.steps=1000"])
with distributed.each_host_first(ranks):  # the single variant's trainers would race to prepare
    open_training_data(config)
rows = []
with tempfile.TemporaryDirectory() as scratch:
    for r in range(rounds):
        for label in variants:
            traced = profile if ranks.is_main and r == 0 else None
            row = measure(
                config, device, ranks, label, Path(scratch) / f"{label}{r}", profile=traced
            )
            row["round"] = r
            rows.append(row)
            if ranks.is_main:
                print(
                    f"{preset} {label:13s} round {r}: {row['tokens_per_s']:,.0f} tok/s, "
                    f"{row['step_ms']:.3f} ms/step, loss {row['last_loss']:.4f}, "
                    f"identical ranks {row.get('ranks_identical', '-')}",
                    flush=True,
                )
if ranks.is_main:
    out.write_text(json.dumps({"preset": preset, "rows": rows}, indent=1))
distributed.stop()
