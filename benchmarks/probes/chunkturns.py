"""Probe: what one chunk turn of a streamed corpus costs the host (docs/decisions/045).

1. Turns: ``advance`` timed at each turn for chunks of ``--pieces-per-chunk`` pieces from
   across the corpus, against chunks that read the same number of bytes as one span (one
   piece a chunk: the layout before decision 045), through the same code; the two layouts'
   turns alternate, so a slower stretch of the machine falls on both.
2. Reads: the host reads of one chunk's pieces into a device buffer through gpuflow's pinned
   reader, all queued at once with one copy (``HostFileReader.read_many``, what an upload
   does now) against one read, one wait and one copy per piece.

JSON on stdout and in ``--out``:

    PYTHONPATH=src python benchmarks/probes/chunkturns.py --device cuda --pieces-per-chunk 64 \\
        --out turns.json

``benchmarks/results/2026-11-28-probe-chunkturns-h100.json`` gathers such runs on one H100.
Without ``--data`` the probe writes a corpus of random uint16 tokens (``--mtokens`` million,
in shards of 10M) into a scratch folder first.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuflow import PinnedPool
from gpuflow.data import resident
from gpuflow.data.resident import UPLOAD_CHUNK_BYTES, ResidentTokens
from gpuflow.data.shards import HEADER_BYTES, Shard, write_shard
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.transfer.diskread import HostFileReader


def random_shards(folder: Path, mtokens: int) -> list[Shard]:
    rng = np.random.default_rng(0)
    shards = []
    for i, start in enumerate(range(0, mtokens, 10)):
        n = min(10, mtokens - start) * 1_000_000
        path = folder / f"train_{i:06d}.bin"
        write_shard(path, rng.integers(0, 16000, size=n, dtype=np.uint16))
        shards.append(Shard.open(path))
    return shards


def build(shards: list[Shard], device: Device, args: argparse.Namespace, per_chunk: int) -> Any:
    default = resident.PIECES_PER_CHUNK
    resident.PIECES_PER_CHUNK = per_chunk  # read as the corpus is cut, when it is built
    try:
        return ResidentTokens(
            shards, device, 16, 128, budget_bytes=int(args.budget_mb * 1e6), vocab_size=65536,
            show_progress=False, io="pinned",
        )  # fmt: skip
    finally:
        resident.PIECES_PER_CHUNK = default


def medians(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "ms": ms}


def turns(shards: list[Shard], device: Device, args: argparse.Namespace) -> dict[str, Any]:
    built = {
        "pieces": build(shards, device, args, args.pieces_per_chunk),
        "one span": build(shards, device, args, 1),
    }
    took: dict[str, list[float]] = {layout: [] for layout in built}
    for turn in range(1, args.turns + 1):
        for layout, tokens in built.items():
            device.synchronize()
            started = time.perf_counter()
            tokens.advance(turn * tokens.steps_per_chunk)
            took[layout].append(time.perf_counter() - started)
    first = built["pieces"]
    stats = first.turn_stats()
    row = {
        "n_chunks": first.n_chunks,
        "piece_tokens": first.piece_tokens,
        "pieces_per_chunk": first.pieces_per_chunk,
        "bytes_per_turn": stats["bytes"] / stats["turns"],
        "span_bytes_per_turn": (lambda s: s["bytes"] / s["turns"])(built["one span"].turn_stats()),
        "turn_stats": stats,
        **{layout: medians(seconds) for layout, seconds in took.items()},
    }
    for tokens in built.values():
        tokens.close()
    return row


def piece_reads(tokens: Any, shards: list[Shard], chunk: int) -> list[tuple[Path, int, int]]:
    """(path, byte offset, tokens) of each piece of ``chunk``, split where a shard ends."""
    starts = list(itertools.accumulate((s.n_tokens for s in shards), initial=0))
    reads = []
    for piece in tokens.chunk_pieces(chunk).tolist():
        lo = piece * tokens.piece_tokens
        hi = min(lo + tokens.piece_tokens, starts[-1])
        while lo < hi:
            index = bisect.bisect_right(starts, lo) - 1
            end = min(hi, starts[index + 1])
            reads.append((shards[index].path, HEADER_BYTES + 2 * (lo - starts[index]), end - lo))
            lo = end
    return reads


def reads(shards: list[Shard], device: Device, args: argparse.Namespace) -> dict[str, Any]:
    tokens = build(shards, device, args, args.pieces_per_chunk)
    reader, pool = HostFileReader(), PinnedPool(device, max_bytes=2 * UPLOAD_CHUNK_BYTES)
    target = torch.empty(tokens.chunk_tokens, dtype=torch.int16, device=device.torch)  # (n,)

    def copy_in(pieces: list[tuple[Path, int, int]], into: int) -> None:
        nbytes = 2 * sum(n for _, _, n in pieces)
        host = pool.acquire(nbytes, timeout=None)
        staged = host.bytes[:nbytes].numpy()  # (nbytes,) uint8, pinned
        at, requests = 0, []
        for path, offset, n in pieces:
            requests.append((path, offset, staged[at : at + 2 * n]))
            at += 2 * n
        reader.read_many(requests)
        target[into : into + nbytes // 2].copy_(host.bytes[:nbytes].view(torch.int16), True)
        copied = device.new_event()
        copied.record(device.current_stream())
        pool.release(host, after=copied)

    took: dict[str, list[float]] = {"grouped": [], "one per piece": []}
    for chunk in range(args.turns):
        pieces = piece_reads(tokens, shards, chunk)
        for way in took:
            device.synchronize()
            started = time.perf_counter()
            if way == "grouped":
                copy_in(pieces, 0)
            else:
                into = 0
                for piece in pieces:
                    copy_in([piece], into)
                    into += piece[2]
            device.synchronize()
            took[way].append(time.perf_counter() - started)
    tokens.close()
    reader.close()
    pool.close()
    return {"reads_per_chunk": len(pieces), **{way: medians(s) for way, s in took.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--mtokens", type=int, default=40)
    parser.add_argument("--budget-mb", type=float, default=16.0)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--pieces-per-chunk", type=int, default=resident.PIECES_PER_CHUNK)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = Device.resolve(args.device)
    row: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device.torch) if device.type == "cuda" else "",
        "budget_mb": args.budget_mb,
        "pieces_per_chunk_asked": args.pieces_per_chunk,
    }
    with tempfile.TemporaryDirectory(prefix="chunkturns-") as scratch:
        if args.data is not None:
            shards = list(TokenFolder.open(args.data).train)
        else:
            shards = random_shards(Path(scratch), args.mtokens)
        row["corpus_tokens"] = sum(s.n_tokens for s in shards)
        row["turns"] = turns(shards, device, args)
        row["reads"] = reads(shards, device, args)
    print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
