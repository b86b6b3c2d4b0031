"""Probe: does a corpus streamed through the device in chunks train like the fully resident
one (docs/decisions/045)? The tiny preset on the CPU, at equal steps, a few seeds per arm:
the corpus resident, streamed in chunks by this tree, and streamed in chunks by an older
tree (``--old-src``, a ``git worktree add /tmp/oldtree <commit>`` checkout's ``src``).
Writes each run's val-loss curve, final val loss, tokens, chunk count and wall time, each
streamed arm's shape and turn times, and each arm's mean and spread.

    PYTHONPATH=src python benchmarks/probes/chunkedsampling.py --old-src /tmp/oldtree/src
    # then more seeds, and a variant tree as one more streamed arm, into the same file:
    ... --append --arms resident,chunked --seeds 4,5,6
    ... --append --arms "" --arm chunked-p256=/tmp/p256/src

``benchmarks/results/2026-11-28-probe-chunkedsampling-cpu.json`` was made so (800 steps);
``benchmarks/results/2026-11-28-probe-chunkedsampling-cpu-300steps.json`` with ``--steps
300`` and variant arms of 256 and 1,024 pieces a chunk. ``--new-src`` (default: this tree's
``src``) lets the runs use a copy that later edits do not reach.

The corpus is text nobody here wrote: the Python sources and docs installed on the machine
(the interpreter's standard library, then the system's and pyenv's installed packages),
one document per file, in path order, gathered until ``--corpus-mb`` and prepared once
into ``--data`` with a BPE of 4096 (the tiny preset's vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    "/usr/lib/python3.11",
    "/usr/lib/python3/dist-packages",
    "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages",
)
SUFFIXES = (".py", ".rst", ".txt", ".md")
MAX_FILE_BYTES = 1 << 20  # larger files are mostly generated tables, not prose or code
SEEDS = (1, 2, 3)
# The corpus's shape as ResidentTokens cuts it in the tree under test, and five chunk turns
# timed on the host (the files already in the page cache).
SHAPE = """
import json, sys, time
from gpuflow.data.tokens import TokenFolder
from gpuflow.data.resident import ResidentTokens
t = ResidentTokens(TokenFolder.open(sys.argv[1]).train, "cpu", 16, 128,
                   budget_bytes=int(sys.argv[2]), show_progress=False)
names = ("n_chunks", "chunk_tokens", "steps_per_chunk", "piece_tokens", "pieces_per_chunk")
row = {k: getattr(t, k, None) for k in names}
took = []
for k in range(1, 6):
    started = time.perf_counter()
    t.advance(k * t.steps_per_chunk)
    took.append(time.perf_counter() - started)
row["turn_seconds"] = took
row["turn_stats"] = t.turn_stats() if hasattr(t, "turn_stats") else None
print(json.dumps(row))
"""


def gather(out: Path, limit_bytes: int) -> int:
    """Write the corpus as JSONL, one file a document; returns its bytes of text."""
    total = 0
    with out.open("w", encoding="utf-8") as f:
        for root in SOURCES:
            for path in sorted(Path(root).rglob("*")):
                if path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                    continue
                if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                    continue
                text = path.read_text(encoding="utf-8", errors="replace")
                if len(text) < 200:
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode())
                if total >= limit_bytes:
                    return total
    return total


def prepare(data: Path, corpus_mb: int) -> dict[str, Any]:
    if not (data / "meta.json").exists():
        raw = data.parent / f"{data.name}-raw.jsonl"
        text_bytes = gather(raw, corpus_mb << 20)
        print(f"gathered {text_bytes / 1e6:.1f} MB of text into {raw}", flush=True)
        command = [sys.executable, "-m", "gpuflow", "prepare", "--data", str(raw)]
        command += ["--out", str(data), "--vocab-size", "4096", "--tokenizer-sample-mb", "40"]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return json.loads((data / "meta.json").read_text())


def shape(src: str, data: Path, budget_bytes: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, "-c", SHAPE, str(data), str(budget_bytes)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(src: str, name: str, sets: list[str], work: Path, steps: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "gpuflow", "train", "--preset", "tiny", "--name", name]
    command += ["--device", "cpu", "--steps", str(steps)]
    command += [a for s in sets for a in ("--set", s)]
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=work, env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").open()]
    curve = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    return {"val_curve": curve, "final_val_loss": curve[-1][1], "wall_s": seconds}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    finals = [r["final_val_loss"] for r in runs]
    return {
        "mean": statistics.fmean(finals),
        "stdev": statistics.stdev(finals) if len(finals) > 1 else None,
        "min": min(finals),
        "max": max(finals),
        "n": len(finals),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old-src", default="/tmp/oldtree/src")
    parser.add_argument("--new-src", default=str(ROOT / "src"))
    # More streamed arms, each run by another tree: NAME=SRC (a variant of this one, say).
    parser.add_argument("--arm", action="append", default=[])
    parser.add_argument("--arms", default="resident,chunked,chunked-old")
    parser.add_argument("--data", type=Path, default=Path("/tmp/chunkcorpus"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/chunkprobe"))
    parser.add_argument("--corpus-mb", type=int, default=48)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--budget-mb", type=float, default=2.0)
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--prepare-only", action="store_true")
    # Add the runs asked for to an existing result (same settings), keeping those it holds.
    parser.add_argument("--append", action="store_true")
    parser.add_argument(
        "--out", type=Path,
        default=ROOT / "benchmarks/results/2026-11-28-probe-chunkedsampling-cpu.json",
    )  # fmt: skip
    args = parser.parse_args()
    meta = prepare(args.data, args.corpus_mb)
    if args.prepare_only:
        print(json.dumps(meta))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    budget_bytes = int(args.budget_mb * 1e6)
    budget = [f"data.device_budget_mb={args.budget_mb}"]
    known = {"resident": (args.new_src, []), "chunked": (args.new_src, budget)}
    known["chunked-old"] = (args.old_src, budget)
    known.update({a.split("=")[0]: (a.split("=", 1)[1], budget) for a in args.arm})
    names = [n for n in args.arms.split(",") if n] + [a.split("=")[0] for a in args.arm]
    arms = {name: known[name] for name in dict.fromkeys(names)}
    if args.append:
        result = json.loads(args.out.read_text())
        for key in ("steps", "eval_interval", "eval_batches", "budget_mb"):
            if result[key] != getattr(args, key):
                raise SystemExit(f"--append: {key} is {result[key]} in {args.out}")
    else:
        result = {
            "probe": "chunkedsampling",
            "device": "cpu",
            "cores": os.cpu_count(),
            "preset": "tiny",
            "steps": args.steps,
            "eval_interval": args.eval_interval,
            "eval_batches": args.eval_batches,
            "budget_mb": args.budget_mb,
            "corpus": {
                "sources": list(SOURCES),
                "train_tokens": meta.get("train_tokens"),
                "val_tokens": meta.get("val_tokens"),
                "documents": meta.get("documents"),
            },
            "shapes": {},
            "runs": {},
        }
    seeds = [int(seed) for seed in args.seeds.split(",")]
    for arm, (src, extra) in arms.items():
        result["runs"].setdefault(arm, [])
        if extra and arm not in result["shapes"]:
            result["shapes"][arm] = {"src": src, **shape(src, args.data, budget_bytes)}
    stamp = time.strftime("%H%M%S")
    for seed in seeds:  # seed-major: a slower stretch of the machine falls on every arm
        for arm, (src, extra) in arms.items():
            if any(run["seed"] == seed for run in result["runs"][arm]):
                continue
            sets = [f"data.dir={args.data}", f"train.seed={seed}"]
            sets += [f"train.eval_interval={args.eval_interval}"]
            sets += [f"train.eval_batches={args.eval_batches}"]
            sets += [f"train.checkpoint_interval={args.steps}", *extra]
            run = train(src, f"{arm}-s{seed}-{stamp}", sets, args.work, args.steps)
            chunks = result["shapes"].get(arm, {}).get("n_chunks", 1)
            tokens = args.steps * 16 * 128
            run = {"seed": seed, "n_chunks": chunks, "tokens_trained": tokens, **run}
            result["runs"][arm].append(run)
            print(f"{arm} seed {seed}: val {run['final_val_loss']:.4f}, {run['wall_s']:.0f} s")
            result["summary"] = {a: summary(r) for a, r in result["runs"].items() if r}
            args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
