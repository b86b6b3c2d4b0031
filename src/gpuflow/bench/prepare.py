"""``gpuflow bench prepare``: ``gpuflow prepare`` beside the script a user would write with the
same ``tokenizers`` library, on the same corpus and machine, each in a child process.

    gpuflow bench prepare --mib 100          # a generated corpus of 100 MiB
    gpuflow bench prepare --data books/ --separator '<|endoftext|>'

Each row: wall time, MB/s of corpus, tokens/s and the peak resident memory of the child's
process tree. The baseline script, how memory is sampled, and the generated corpus:
docs/architecture/benches.md (gpuflow bench prepare).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.data.encode import usable_cores

SEPARATOR = "<|endoftext|>"
FILE_BYTES = 16 << 20

# The hand-written pipeline: the baseline, run as a script of its own.
BASELINE = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

files, separator, vocab, out = json.loads(sys.argv[1])
started = time.perf_counter()
docs = []
for f in files:
    text = Path(f).read_text(encoding="utf-8")
    docs += [d.strip() for d in (text.split(separator) if separator else [text]) if d.strip()]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(docs, trainer)
trained = time.perf_counter()
eot = tok.token_to_id("<|endoftext|>")
tokens = 0
with open(out, "wb") as f:
    for i in range(0, len(docs), 2048):
        for enc in tok.encode_batch(docs[i : i + 2048], add_special_tokens=False):
            ids = np.array([eot, *enc.ids], dtype=np.uint16)
            f.write(ids.tobytes())
            tokens += ids.size
done = time.perf_counter()
print(json.dumps({"train_s": trained - started, "encode_s": done - trained, "tokens": tokens,
                  "documents": len(docs)}))
"""


@dataclass(frozen=True)
class PrepareBenchConfig:
    mib: int = 100
    data: tuple[str, ...] = ()  # empty: a generated corpus of ``mib``
    separator: str | None = None  # with --data: how its text files hold documents
    vocab_size: int = 16000
    workers: int = 0  # gpuflow's; 0: every core

    def __post_init__(self) -> None:
        if self.mib < 1:
            raise GpuflowError(f"--mib must be >= 1, got {self.mib}")


def generate_corpus(folder: Path, mib: int) -> list[Path]:
    """``mib`` MiB of text files of the built-in corpus's documents, reshuffled per copy."""
    from gpuflow.data.corpus import default_corpus

    texts = [d.text for d in default_corpus()]
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    files, written, target = [], 0, mib << 20
    while written < target:
        order = texts[:]
        rng.shuffle(order)
        body = f"\n{SEPARATOR}\n".join(order).encode("utf-8")
        body = body[: min(len(body), FILE_BYTES, target - written)]
        body = body[: len(body.decode("utf-8", "ignore").encode("utf-8"))]  # whole characters
        path = folder / f"part_{len(files):04d}.txt"
        path.write_bytes(body)
        files.append(path)
        written += len(body)
    return files


class TreeMemory:
    """The peak of the summed resident memory of a process and every process below it."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _tree_rss(self.pid))
            self._done.wait(self.every)


def _tree_rss(root: int) -> int:
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid, parent = int(entry.name), int(fields.get("PPid", "0").strip() or 0)
        children.setdefault(parent, []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, queue = 0, [root]
    while queue:
        pid = queue.pop()
        total += rss.get(pid, 0)
        queue += children.get(pid, [])
    return total


def run_timed(command: list[str], cwd: Path) -> dict[str, Any]:
    """Run ``command`` in ``cwd`` to its end: its seconds, the peak memory of its process
    tree and its stdout; a failure is one line naming the command's last stderr line."""
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    memory = TreeMemory(child.pid)
    out, err = child.communicate()
    seconds = time.perf_counter() - started
    peak = memory.stop()
    if child.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["(nothing on stderr)"]
        raise GpuflowError(f"bench prepare: {command[2]} failed: {last[0]}")
    return {"seconds": seconds, "peak_rss_bytes": peak, "stdout": out.decode(errors="replace")}


def run_prepare_bench(bench: PrepareBenchConfig) -> dict[str, Any]:
    from gpuflow.common.console import err_console
    from gpuflow.data.formats import resolve_inputs

    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-prepare-"))
    try:
        if bench.data:
            inputs = resolve_inputs(list(bench.data))
            if any(i.kind != "text" or i.compression or i.path is None for i in inputs):
                raise GpuflowError(
                    "bench prepare's baseline reads plain text files: pass .txt/.md files or "
                    "folders of them with --data"
                )
            files = [i.path for i in inputs]
            separator = bench.separator
        else:
            err_console.print(f"generating a {bench.mib} MiB corpus...")
            files, separator = generate_corpus(scratch / "corpus", bench.mib), SEPARATOR
        corpus_bytes = sum(p.stat().st_size for p in files)
        err_console.print(f"baseline: the tokenizers script on {corpus_bytes / 2**20:,.0f} MiB...")
        spec = json.dumps([[str(p.absolute()) for p in files], separator, bench.vocab_size,
                           str(scratch / "baseline.bin")])  # fmt: skip
        base = run_timed([sys.executable, "-c", BASELINE, spec], scratch)
        base.update(json.loads(base.pop("stdout").strip().splitlines()[-1]))
        err_console.print("gpuflow prepare...")
        command = [sys.executable, "-m", "gpuflow", "prepare", "--out", str(scratch / "ours"),
                   "--vocab-size", str(bench.vocab_size), "--workers", str(bench.workers),
                   "--data", *(str(p.absolute()) for p in files)]  # fmt: skip
        if separator:
            command += ["--separator", separator]
        ours = run_timed(command, scratch)
        ours.pop("stdout")
        meta = json.loads((scratch / "ours" / "meta.json").read_text())
        ours.update(tokens=meta["train_tokens"] + meta["val_tokens"], documents=meta["documents"],
                    forced_cuts=meta.get("forced_cuts", 0))  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for label, row in (("tokenizers script", base), ("gpuflow prepare", ours)):
        rows.append({
            "row": label,
            **row,
            "mb_per_s": corpus_bytes / 1e6 / row["seconds"],
            "tokens_per_s": row["tokens"] / row["seconds"],
        })  # fmt: skip
    rows[0]["encode_tokens_per_s"] = base["tokens"] / base["encode_s"]
    return {
        "corpus": "generated" if not bench.data else list(bench.data),
        "corpus_bytes": corpus_bytes,
        "files": len(files),
        "separator": separator,
        "vocab_size": bench.vocab_size,
        "cores": usable_cores(),
        "workers": bench.workers or usable_cores(),
        "rows": rows,
        "speedup": rows[0]["seconds"] / rows[1]["seconds"],
        "memory_ratio": rows[1]["peak_rss_bytes"] / max(rows[0]["peak_rss_bytes"], 1),
    }


def print_prepare_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    out = table(
        "row", "wall s", "MB/s", "tokens/s", "peak RSS", "tokens", "documents",
        title=(
            f"prepare: {result['corpus_bytes'] / 2**20:,.0f} MiB in {result['files']} files, "
            f"vocab {result['vocab_size']:,}, {result['cores']} cores"
        ),
    )  # fmt: skip
    for row in result["rows"]:
        wall = f"{row['seconds']:.1f}"
        if "train_s" in row:
            wall += f" (train {row['train_s']:.1f}, encode {row['encode_s']:.1f})"
        out.add_row(
            row["row"], wall, f"{row['mb_per_s']:.2f}", f"{row['tokens_per_s']:,.0f}",
            f"{row['peak_rss_bytes'] / 2**30:.2f} GiB", f"{row['tokens']:,}",
            f"{row['documents']:,}",
        )  # fmt: skip
    out_console.print(out)
    out_console.print(
        f"gpuflow vs the script: {result['speedup']:.2f}x the speed, "
        f"{result['memory_ratio']:.2f}x the peak memory"
    )
