"""What a run's folder says about the run once it stops: ``report.json`` (its summary, from
``metrics.jsonl`` and the ``TrainResult``) and ``training.png`` (loss and tokens/s against
step). Written at the end of ``gpuflow train``, after the last checkpoint."""

from __future__ import annotations

import dataclasses
import io
import json
import platform
from pathlib import Path
from typing import Any

import torch

from gpuflow.common.atomic import write_atomic, write_text_atomic
from gpuflow.train.config import RunConfig, to_dict
from gpuflow.train.runfolder import PLOT_FILE, REPORT_FILE, read_metrics
from gpuflow.train.trainer import TrainResult


def build_report(config: RunConfig, result: TrainResult) -> dict[str, Any]:
    records = read_metrics(result.run_dir)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    # The best counts the evaluations on the run's validation windows as they are now.
    since = result.val_since
    comparable = [r for r in val if since is None or r["step"] > since]
    bpbs = [r["val_bpb"] for r in comparable if "val_bpb" in r]
    return {
        "run": result.run_dir.name,
        "preset": config.preset,
        "steps_done": result.last_step,
        "steps_planned": config.train.steps,
        "resumed_from": result.start_step or None,
        "interrupted": result.interrupted,
        "seconds_this_session": round(result.seconds, 3),
        "parameters": result.parameters,
        "world_size": result.world_size,
        "tokens_per_step": result.tokens_per_step,  # of the job: every rank's batch
        "micro_batch": result.micro_batch,  # sequences in one forward and backward
        "accumulation": result.accumulation,  # micro-batches per step on each rank
        "tokens_per_s": result.tokens_per_s,
        "tokens_per_s_per_rank": (
            result.tokens_per_s / result.world_size if result.tokens_per_s else None
        ),
        "collective_bytes_per_step_per_rank": result.collective_bytes_per_step,
        "exchange": result.exchange,  # how: NCCL's collectives, or the GPUs' peer memory
        "peak_device_bytes_per_rank": result.peak_device_bytes,  # allocated, in rank order
        "data_io": dataclasses.asdict(result.data_io) if result.data_io else None,
        "chunk_turns": result.chunk_turns,  # a corpus streamed in chunks: what its turns cost
        "mfu": result.mfu,
        "first_train_loss": train[0]["loss"] if train else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "final_val_step": val[-1]["step"] if val else None,
        "best_val_loss": min(r["val_loss"] for r in comparable) if comparable else None,
        # Bits per UTF-8 byte of the validation targets: comparable across tokenizers. None
        # where the run's data has no byte-level tokenizer.json to count the bytes with.
        "final_val_bpb": val[-1].get("val_bpb") if val else None,
        "best_val_bpb": min(bpbs) if bpbs else None,
        "device": result.device,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "config": to_dict(config),
    }


def write_report(config: RunConfig, result: TrainResult) -> dict[str, Any]:
    report = build_report(config, result)
    write_text_atomic(result.run_dir / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    plot_run(result.run_dir)
    return report


def plot_run(run_dir: Path) -> Path | None:
    """Write training.png: train/val loss and tokens/s against step. None without data."""
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax_loss.set_ylabel("cross-entropy (nats)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    rates = [r.get("tokens_per_s") for r in train]  # (a record may be without one)
    ax_rate.plot([r["step"] for r in train], rates, color="tab:green")
    ax_rate.set_ylabel("tokens/s")
    ax_rate.set_xlabel("step")
    ax_rate.grid(alpha=0.3)
    fig.suptitle(f"gpuflow run {Path(run_dir).name}")
    fig.tight_layout()
    png = io.BytesIO()  # drawn in memory, then written as every file of a run is
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    out = Path(run_dir) / PLOT_FILE
    write_atomic(out, [png.getbuffer()])  # a PID-named temporary, never through a link
    return out
