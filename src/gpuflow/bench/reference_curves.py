"""What ``gpuflow bench reference`` reads from its children and shows: nanoGPT's curve from
its output lines, gpuflow's from its run folder, the gap between them, the figure and the
table. The bench itself, and what both trainers are given: ``gpuflow.bench.reference``.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from gpuflow.bench.placement import Finished
from gpuflow.bench.scale import last_words
from gpuflow.common.errors import GpuflowError
from gpuflow.train.runfolder import METRICS_FILE, REPORT_FILE, read_metrics

NANOGPT_SEED = 1337  # train.py seeds torch with 1337 whatever it is told
SETTLE_ITERS = 5  # nanoGPT's iterations before its timing counts (as its own MFU does)
# Fewer timed iterations than this, and the table says nanoGPT's figure rests on few.
STEADY_ITERS = 10

_NANO_EVAL = re.compile(r"^step (\d+): train loss (\S+), val loss (\S+)$")
_NANO_ITER = re.compile(r"^iter (\d+): loss (\S+), time (\S+)ms, mfu (\S+)%$")
_NANO_TOKENS = re.compile(r"^tokens per iteration will be: ([\d,]+)$")
_OUR_VAL = re.compile(r"^step\s+(\d+)/\d+\s+val loss ")  # gpuflow train's plain-line display


# ---- reading what the children left ------------------------------------------------------


def parse_nanogpt(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """nanoGPT's evaluations (step, train and val loss, seconds since its start), its
    iterations (iter, loss, ms) and the tokens per iteration it announced, from its output."""
    evals, iters, tokens = [], [], None
    for seconds, text in lines:
        if m := _NANO_EVAL.match(text):
            evals.append((int(m[1]), float(m[2]), float(m[3]), seconds))
        elif m := _NANO_ITER.match(text):
            iters.append((int(m[1]), float(m[2]), float(m[3])))
        elif m := _NANO_TOKENS.match(text):
            tokens = int(m[1].replace(",", ""))
    return {"evals": evals, "iters": iters, "tokens_per_iter": tokens}


def nanogpt_run(finished: Finished, tokens_per_step: int, eval_interval: int) -> dict[str, Any]:
    """nanoGPT's curve and speed: tokens/s from the median time of its iterations after
    ``SETTLE_ITERS``, less those that began with an evaluation (every ``eval_interval``-th:
    nanoGPT times an iteration from the end of the one before, so an evaluation and the
    checkpoint it may save fall into it; where every logged iteration evaluated, a median
    over them would be the evaluations')."""
    parsed = parse_nanogpt(finished.lines)
    output = "\n".join(text for _, text in finished.lines)
    if not parsed["evals"]:
        raise GpuflowError(
            "bench reference: nanoGPT wrote no 'step N: train loss X, val loss Y' line; is "
            f"--nanogpt nanoGPT's train.py? its last words: {last_words(output)}"
        )
    if parsed["tokens_per_iter"] not in (None, tokens_per_step):
        raise GpuflowError(
            f"bench reference: nanoGPT trained {parsed['tokens_per_iter']:,} tokens an "
            f"iteration, not the {tokens_per_step:,} it was given: its train.py does not take "
            "these settings"
        )
    settled = [ms for it, _, ms in parsed["iters"] if it >= SETTLE_ITERS and it % eval_interval]
    median_ms = statistics.median(settled) if settled else None
    curve = [
        {"step": step, "tokens": step * tokens_per_step, "val_loss": val, "train_loss": train,
         "seconds": seconds}
        for step, train, val, seconds in parsed["evals"]
    ]  # fmt: skip
    return {
        "trainer": "nanogpt", "label": finished.job.label, "seed": NANOGPT_SEED,
        "gpu": finished.slot.get("CUDA_VISIBLE_DEVICES"), "wall_s": finished.seconds,
        "iteration_ms": median_ms, "iterations_timed": len(settled),
        "tokens_per_s": tokens_per_step / (median_ms / 1e3) if median_ms else None,
        "mfu": None, "final_val_loss": curve[-1]["val_loss"], "curve": curve,
    }  # fmt: skip


def gpuflow_run(finished: Finished, run_dir: Path, tokens_per_step: int, seed: int) -> dict:
    """A gpuflow run's curve (val losses from metrics.jsonl; the second each appeared on its
    output, counted from the child's start as nanoGPT's are) and speed (report.json)."""
    if not (run_dir / REPORT_FILE).is_file() or not (run_dir / METRICS_FILE).is_file():
        raise GpuflowError(f"bench reference: {finished.job.label} ended without a {REPORT_FILE}")
    report = json.loads((run_dir / REPORT_FILE).read_text())
    seen: dict[int, float] = {}
    for seconds, text in finished.lines:
        if m := _OUR_VAL.match(text):
            seen.setdefault(int(m[1]), seconds)
    curve = [
        {"step": r["step"], "tokens": r["step"] * tokens_per_step, "val_loss": r["val_loss"],
         "seconds": seen.get(r["step"])}
        for r in read_metrics(run_dir) if "val_loss" in r
    ]  # fmt: skip
    if not curve:
        raise GpuflowError(f"bench reference: {finished.job.label} recorded no val loss")
    return {
        "trainer": "gpuflow", "label": finished.job.label, "seed": seed,
        "gpu": finished.slot.get("CUDA_VISIBLE_DEVICES"), "wall_s": finished.seconds,
        "tokens_per_s": report.get("tokens_per_s"), "mfu": report.get("mfu"),
        "final_val_loss": curve[-1]["val_loss"], "curve": curve,
    }  # fmt: skip


def compare(nano: dict[str, Any], ours: list[dict[str, Any]]) -> dict[str, Any]:
    """The gap (gpuflow's first run minus nanoGPT) at every step both evaluated, the spread
    of gpuflow's own runs at each step they share (max - min, with two seeds or more), the
    final and best losses, and when gpuflow first reached nanoGPT's final and best."""
    first = ours[0]
    theirs = {p["step"]: p["val_loss"] for p in nano["curve"]}
    by_seed = [{p["step"]: p["val_loss"] for p in run["curve"]} for run in ours]
    spread = {}
    if len(ours) > 1:
        for step in sorted(set.intersection(*(set(s) for s in by_seed))):
            values = [s[step] for s in by_seed]
            spread[step] = max(values) - min(values)
    gaps = [
        {"step": p["step"], "tokens": p["tokens"], "gpuflow": p["val_loss"],
         "nanogpt": theirs[p["step"]], "gap": p["val_loss"] - theirs[p["step"]],
         "seed_spread": spread.get(p["step"])}
        for p in first["curve"] if p["step"] in theirs
    ]  # fmt: skip
    target, best = nano["final_val_loss"], min(p["val_loss"] for p in nano["curve"])
    reached = next((p for p in first["curve"] if p["val_loss"] <= target), None)
    reached_best = next((p for p in first["curve"] if p["val_loss"] <= best), None)
    ours_rate, theirs_rate = first["tokens_per_s"], nano["tokens_per_s"]
    speedup = ours_rate / theirs_rate if ours_rate and theirs_rate else None
    return {
        "gaps": gaps,
        "seed_spread": [{"step": s, "spread": v} for s, v in spread.items()],
        "seed_spread_max": max(spread.values()) if spread else None,
        "final": {
            "nanogpt": target,
            "gpuflow": first["final_val_loss"],
            "gap": first["final_val_loss"] - target,
        },
        # A curve that rises again (a corpus read many times over) passes nanoGPT's final
        # loss on its way down: its best loss says more there.
        "best": {"nanogpt": best, "gpuflow": min(p["val_loss"] for p in first["curve"])},
        "gpuflow_s_to_nanogpt_final": reached["seconds"] if reached else None,
        "gpuflow_tokens_to_nanogpt_final": reached["tokens"] if reached else None,
        "nanogpt_s_to_final": nano["curve"][-1]["seconds"],
        "gpuflow_s_to_nanogpt_best": reached_best["seconds"] if reached_best else None,
        "nanogpt_s_to_best": next(p["seconds"] for p in nano["curve"] if p["val_loss"] == best),
        "speedup": speedup,
    }


# ---- showing it --------------------------------------------------------------------------


def plot_reference(result: dict[str, Any], path: Path) -> Path:
    """Val loss against tokens (left) and against wall seconds (right), every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in result["runs"]:
        nano = run["trainer"] == "nanogpt"
        style = {"color": "black" if nano else None, "marker": "o", "ms": 3, "lw": 1.2,
                 "label": run["label"]}  # fmt: skip
        curve = run["curve"]
        by_tokens.plot([p["tokens"] for p in curve], [p["val_loss"] for p in curve], **style)
        timed = [p for p in curve if p["seconds"] is not None]
        by_time.plot([p["seconds"] for p in timed], [p["val_loss"] for p in timed], **style)
    by_tokens.set_xlabel("tokens trained")
    by_tokens.set_ylabel("validation loss")
    by_time.set_xlabel("seconds since the process started")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    fig.suptitle(
        f"gpuflow vs nanoGPT train.py: {result['preset']}, {result['steps']:,} steps of "
        f"{result['batching']['tokens_per_step']:,} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_reference_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    batching = result["batching"]
    out = table(
        "run", "seed", "tokens/s", "MFU", "wall", "final val loss", "best val loss",
        "reached nanoGPT's final",
        title=(
            f"{result['preset']}: {result['steps']:,} steps of {batching['tokens_per_step']:,} "
            f"tokens ({batching['accumulation']} x {batching['micro_batch']} sequences)"
        ),
    )  # fmt: skip
    first_gpuflow = next(r for r in result["runs"] if r["trainer"] == "gpuflow")
    for run in result["runs"]:
        reached = "-"
        if run is first_gpuflow:
            s = result["gpuflow_s_to_nanogpt_final"]
            reached = f"{s:.1f} s" if s is not None else "[bold red]not reached[/]"
        elif run["trainer"] == "nanogpt":
            reached = f"{result['nanogpt_s_to_final']:.1f} s"
        out.add_row(
            run["label"], str(run["seed"]),
            f"{run['tokens_per_s']:,.0f}" if run["tokens_per_s"] else "-",
            f"{run['mfu']:.1%}" if run["mfu"] is not None else "-",
            f"{run['wall_s']:.1f} s", f"{run['final_val_loss']:.4f}",
            f"{min(p['val_loss'] for p in run['curve']):.4f}", reached,
        )  # fmt: skip
    out_console.print(out)
    gaps = result["gaps"]
    if gaps:
        worst = max(gaps, key=lambda g: abs(g["gap"]))
        line = (
            f"val loss gap (gpuflow - nanoGPT) over {len(gaps)} shared steps: final "
            f"{result['final']['gap']:+.4f}, largest {worst['gap']:+.4f} at step {worst['step']}"
        )
        if result["seed_spread_max"] is not None:
            line += f"; gpuflow's seed-to-seed spread up to {result['seed_spread_max']:.4f}"
        out_console.print(line)
    best = result["best"]["nanogpt"]
    if best < result["final"]["nanogpt"]:  # its curve rose again: say when its best was met
        s = result["gpuflow_s_to_nanogpt_best"]
        out_console.print(
            f"nanoGPT's best val loss {best:.4f} came after {result['nanogpt_s_to_best']:.1f} s; "
            + (f"gpuflow's after {s:.1f} s" if s is not None else "gpuflow never reached it")
        )
    if result["speedup"]:
        out_console.print(f"gpuflow trains {result['speedup']:.2f}x nanoGPT's tokens/s")
    timed = next(r for r in result["runs"] if r["trainer"] == "nanogpt")["iterations_timed"]
    if timed < STEADY_ITERS:
        out_console.print(
            f"nanoGPT's tokens/s is the median of {timed} timed iteration"
            f"{'s' if timed != 1 else ''} (the first {SETTLE_ITERS} and those that evaluated "
            "are left out): more --steps give a steadier figure"
        )
