"""``gpuflow bench prepare``: ``gpuflow prepare`` beside the script a user would write with the
same ``tokenizers`` library, on the same corpus and machine, each in a child process.

    gpuflow bench prepare --mib 100          # a generated corpus of 100 MiB
    gpuflow bench prepare --data books/ --separator '<|endoftext|>'
    gpuflow bench prepare --data corpus.jsonl.zst more/   # any input prepare reads

Each row: wall time, MB/s of corpus, tokens/s, the peak resident memory of the child's
largest process and of its whole process tree, and its tokenizer's tokens per byte on
documents held out of both trainings. The baseline script, how memory is sampled, the held-out
documents and the generated corpus: docs/architecture/benches.md (gpuflow bench prepare).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.bench.scale import stop_child
from gpuflow.bench.treememory import TreeMemory
from gpuflow.common.errors import GpuflowError
from gpuflow.common.signals import interrupts_deferred
from gpuflow.data.prepare.encode import usable_cores

SEPARATOR = "<|endoftext|>"
FILE_BYTES = 16 << 20
# Every HOLD_OUT_EVERY-th document, up to HELD_OUT_CHARS of text, is kept out of both trainings
# to measure each tokenizer on text it has not seen.
HOLD_OUT_EVERY = 20
HELD_OUT_CHARS = 4 << 20

# The hand-written pipeline: the baseline, run as a script of its own. It reads text files
# (documents between separators) or JSON lines (a "text" field), as a user's script would.
BASELINE = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

files, kind, separator, vocab, out, saved = json.loads(sys.argv[1])
started = time.perf_counter()
docs = []
for f in files:
    if kind == "jsonl":
        with open(f, encoding="utf-8") as lines:
            docs += [d for d in (json.loads(line)["text"] for line in lines) if d.strip()]
        continue
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
tok.save(saved)
print(json.dumps({"train_s": trained - started, "encode_s": done - trained, "tokens": tokens,
                  "documents": len(docs)}))
"""


@dataclass(frozen=True)
class PrepareBenchConfig:
    mib: int = 100
    data: tuple[str, ...] = ()  # empty: a generated corpus of ``mib``
    separator: str | None = None  # with --data: how its text files hold documents
    vocab_size: int = 16000
    workers: int = 0  # gpuflow's; 0: prepare's default

    def __post_init__(self) -> None:
        if self.mib < 1:
            raise GpuflowError(f"--mib must be >= 1, got {self.mib}")


def generate_corpus(folder: Path, mib: int) -> tuple[list[Path], int]:
    """``mib`` MiB of text files of the built-in corpus's documents, reshuffled per copy (the
    held-out ones, ``builtin_held_out()``, left out), and the characters they hold."""
    from gpuflow.data.prepare.corpus import default_corpus

    held = HoldOut()
    texts = [d.text for d in default_corpus() if not held(d.text)]
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    files, written, chars, target = [], 0, 0, mib << 20
    while written < target:
        order = texts[:]
        rng.shuffle(order)
        body = f"\n{SEPARATOR}\n".join(order).encode("utf-8")
        body = body[: min(len(body), FILE_BYTES, target - written)]
        text = body.decode("utf-8", "ignore")  # whole characters
        body = text.encode("utf-8")
        chars += len(text)
        path = folder / f"part_{len(files):04d}.txt"
        path.write_bytes(body)
        files.append(path)
        written += len(body)
    return files, chars


def builtin_held_out() -> list[str]:
    """The built-in documents the generated corpus leaves out."""
    from gpuflow.data.prepare.corpus import default_corpus

    held = HoldOut()
    for document in default_corpus():
        held(document.text)
    return held.texts


class HoldOut:
    """``held(text)``: whether the next document is held out (then kept in ``held.texts``):
    every ``HOLD_OUT_EVERY``-th, while those held are shorter than ``HELD_OUT_CHARS``."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.seen = self.chars = 0

    def __call__(self, text: str) -> bool:
        self.seen += 1
        if self.seen % HOLD_OUT_EVERY or self.chars >= HELD_OUT_CHARS:
            return False
        self.texts.append(text)
        self.chars += len(text)
        return True


def write_documents(
    data: tuple[str, ...], separator: str | None, folder: Path
) -> tuple[list[Path], list[str], int]:
    """The documents of ``data`` (any input ``prepare`` reads) as JSON lines in ``folder``,
    files of about ``FILE_BYTES``, less the held-out ones, which are returned, with the
    characters of those written."""
    from gpuflow.data.prepare.corpus import Corpus
    from gpuflow.data.prepare.formats import ReadOptions

    folder.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    held = HoldOut()
    written, out, chars = FILE_BYTES, None, 0
    try:
        for text in _documents(Corpus(data, ReadOptions(separator, "text"))):
            if held(text):
                continue
            chars += len(text)
            if written >= FILE_BYTES:
                if out is not None:
                    out.close()
                files.append(folder / f"part_{len(files):04d}.jsonl")
                out, written = open(files[-1], "w", encoding="utf-8"), 0  # noqa: SIM115
            written += out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    finally:
        if out is not None:
            out.close()
    if not files:
        raise GpuflowError(f"bench prepare: {', '.join(data)} holds too few documents")
    return files, held.texts, chars


def _documents(corpus: Any) -> Iterator[str]:
    """Each whole document of ``corpus`` (its parts joined)."""
    held: list[str] = []
    for part in corpus.parts():
        if part.starts_document and held:
            yield "".join(held)
            held = []
        held.append(part.text)
    if held:
        yield "".join(held)


def tokens_per_byte(tokenizer_json: Path, texts: list[str]) -> float | None:
    """Tokens per UTF-8 byte of ``texts`` encoded by the tokenizer saved in ``tokenizer_json``
    (fewer is better); None without texts."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if not nbytes:
        return None
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return tokens / nbytes


def run_timed(command: list[str], cwd: Path) -> dict[str, Any]:
    """Run ``command`` in ``cwd`` to its end: its seconds, the peak memory of its process
    tree (summed, of its largest process, of itself, of each other process) and its stdout;
    a failure is one line naming the command's last stderr line."""
    started = time.perf_counter()
    child = memory = None
    try:
        # A session of its own: Ctrl-C and SIGTERM reach the bench, which stops the child
        # before its scratch folder goes, rather than leave it writing there.
        with interrupts_deferred():
            child = subprocess.Popen(
                command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
        memory = TreeMemory(child.pid)
        out, err = child.communicate()
    finally:
        if child is not None:
            stop_child(child)  # a no-op when it has ended
        peaks = memory.stop() if memory is not None else None
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["(nothing on stderr)"]
        raise GpuflowError(f"bench prepare: {command[2]} failed: {last[0]}")
    return {
        "seconds": seconds,
        "stderr": err.decode(errors="replace"),
        "peak_rss_bytes": peaks.total,
        "peak_process_bytes": peaks.largest,
        "peak_main_bytes": peaks.each.get(child.pid, 0),
        "process_peaks_bytes": peaks.others,
        "stdout": out.decode(errors="replace"),
    }


def _run_ours(
    bench: PrepareBenchConfig, files: list[Path], separator: str | None, scratch: Path,
    name: str, held: list[str], sample_mb: float | None,
) -> dict[str, Any]:  # fmt: skip
    """``gpuflow prepare`` on ``files`` into ``scratch / name``, timed, its tokenizer measured
    on ``held``; ``sample_mb``: its tokenizer's sample (None: prepare's default)."""
    from gpuflow.common.console import err_console

    err_console.print(
        "gpuflow prepare" + ("..." if sample_mb is None else ", its tokenizer on all of it...")
    )
    command = [sys.executable, "-m", "gpuflow", "prepare", "--out", str(scratch / name),
               "--vocab-size", str(bench.vocab_size), "--workers", str(bench.workers),
               "--data", *(str(p.absolute()) for p in files)]  # fmt: skip
    if separator:
        command += ["--separator", separator]
    if sample_mb is not None:
        command += ["--tokenizer-sample-mb", f"{sample_mb:.0f}"]
    row = run_timed(command, scratch)
    row.pop("stdout")
    # prepare's line where the trainer passed its memory and a smaller sample was trained
    row["tokenizer_sample_reduced"] = "note: training the tokenizer on" in row.pop("stderr")
    meta = json.loads((scratch / name / "meta.json").read_text())
    row["train_s"] = meta["tokenizer_seconds"]
    row["encode_s"] = row["seconds"] - row["train_s"]  # start-up, reading, encoding, writing
    row.update(tokens=meta["train_tokens"] + meta["val_tokens"], documents=meta["documents"],
               forced_cuts=meta.get("forced_cuts", 0))  # fmt: skip
    row["tokens_per_byte"] = tokens_per_byte(scratch / name / "tokenizer.json", held)
    return row


def run_prepare_bench(bench: PrepareBenchConfig) -> dict[str, Any]:
    from gpuflow.common.console import err_console
    from gpuflow.data.prepare.encode import default_workers
    from gpuflow.data.prepare.pipeline import DEFAULT_SAMPLE_MB, POOL_MIN_BYTES
    from gpuflow.data.tokenizer_file import load_tokenizer

    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-prepare-"))
    try:
        if bench.data:
            err_console.print(f"reading {', '.join(bench.data)}...")
            files, held, chars = write_documents(bench.data, bench.separator, scratch / "corpus")
            kind, separator = "jsonl", None
        else:
            err_console.print(f"generating a {bench.mib} MiB corpus...")
            files, chars = generate_corpus(scratch / "corpus", bench.mib)
            held, kind, separator = builtin_held_out(), "text", SEPARATOR
        corpus_bytes = sum(p.stat().st_size for p in files)
        err_console.print(f"baseline: the tokenizers script on {corpus_bytes / 2**20:,.0f} MiB...")
        saved = [str(scratch / "baseline.bin"), str(scratch / "baseline.json")]
        spec = json.dumps([[str(p.absolute()) for p in files], kind, separator, bench.vocab_size,
                           *saved])  # fmt: skip
        base = run_timed([sys.executable, "-c", BASELINE, spec], scratch)
        base.update(json.loads(base.pop("stdout").strip().splitlines()[-1]))
        base.pop("stderr")
        base["tokens_per_byte"] = tokens_per_byte(scratch / "baseline.json", held)
        ours = _run_ours(bench, files, separator, scratch, "ours", held, sample_mb=None)
        # The script trains on all of the corpus; prepare on a sample of it by default. Where
        # the two differ, prepare also runs as the script does, so both choices are measured.
        whole = None
        if chars > DEFAULT_SAMPLE_MB * 1e6:  # (prepare's sample counts characters)
            whole = _run_ours(bench, files, separator, scratch, "whole", held,
                              sample_mb=corpus_bytes / 1e6 * 2)  # fmt: skip
        workers = bench.workers or (
            default_workers(load_tokenizer(scratch / "ours")) if corpus_bytes >= POOL_MIN_BYTES
            else 1
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    runs = [("tokenizers script", base), ("gpuflow prepare", ours)]
    if whole is not None:
        runs.append(("gpuflow prepare, tokenizer on all of it", whole))
    for label, row in runs:
        rows.append({
            "row": label,
            **row,
            "mb_per_s": corpus_bytes / 1e6 / row["seconds"],
            "tokens_per_s": row["tokens"] / row["seconds"],
        })  # fmt: skip
    rows[0]["encode_tokens_per_s"] = base["tokens"] / base["encode_s"]
    ratio = None
    if base["tokens_per_byte"] and ours["tokens_per_byte"]:
        ratio = ours["tokens_per_byte"] / base["tokens_per_byte"]
    return {
        "corpus": "generated" if not bench.data else list(bench.data),
        "corpus_bytes": corpus_bytes,
        "files": len(files),
        "separator": bench.separator if bench.data else separator,
        "vocab_size": bench.vocab_size,
        "cores": usable_cores(),
        "workers": workers,
        "held_out_documents": len(held),
        "held_out_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in held),
        "rows": rows,
        "speedup": rows[0]["seconds"] / rows[1]["seconds"],
        "memory_ratio": rows[1]["peak_rss_bytes"] / max(rows[0]["peak_rss_bytes"], 1),
        "process_memory_ratio": rows[1]["peak_process_bytes"]
        / max(rows[0]["peak_process_bytes"], 1),
        "tokens_per_byte_ratio": ratio,
        "tokenizer_sample_mb": DEFAULT_SAMPLE_MB,
        "speedup_trained_on_all": None if whole is None else base["seconds"] / whole["seconds"],
    }


def print_prepare_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    out = table(
        "row", "wall s", "MB/s", "tokens/s", "peak process", "peak tree", "tokens/byte",
        "tokens", "documents",
        title=(
            f"prepare: {result['corpus_bytes'] / 2**20:,.0f} MiB in {result['files']} files, "
            f"vocab {result['vocab_size']:,}, {result['cores']} cores; tokens/byte on "
            f"{result['held_out_documents']:,} held-out documents"
        ),
    )  # fmt: skip
    for row in result["rows"]:
        wall = f"{row['seconds']:.1f}"
        if "train_s" in row:
            wall += f" (train {row['train_s']:.1f}, encode {row['encode_s']:.1f})"
        per_byte = row["tokens_per_byte"]
        out.add_row(
            row["row"], wall, f"{row['mb_per_s']:.2f}", f"{row['tokens_per_s']:,.0f}",
            f"{row['peak_process_bytes'] / 2**30:.2f} GiB",
            f"{row['peak_rss_bytes'] / 2**30:.2f} GiB ({len(row['process_peaks_bytes']) + 1})",
            "-" if per_byte is None else f"{per_byte:.4f}", f"{row['tokens']:,}",
            f"{row['documents']:,}",
        )  # fmt: skip
    out_console.print(out)
    for row in result["rows"]:
        if row.get("tokenizer_sample_reduced"):
            out_console.print(
                f"note: {row['row']}: the tokenizer's trainer passed its memory limit, so it "
                "was trained on a smaller sample than the row says"
            )
    quality = ""
    if result["tokens_per_byte_ratio"] is not None:
        quality = f", {result['tokens_per_byte_ratio']:.3f}x the tokens per held-out byte"
    sample = ""
    if result.get("speedup_trained_on_all") is not None:
        sample = f" (its tokenizer on a {result['tokenizer_sample_mb']:g} MB sample)"
    out_console.print(
        f"gpuflow vs the script: {result['speedup']:.2f}x the speed{sample}, "
        f"{result['process_memory_ratio']:.2f}x the peak of one process, "
        f"{result['memory_ratio']:.2f}x the peak of the process tree{quality}"
    )
    if sample:
        base, whole = result["rows"][0], result["rows"][2]
        per_byte = ""
        if base["tokens_per_byte"] and whole["tokens_per_byte"]:
            per_byte = (
                f", {whole['tokens_per_byte'] / base['tokens_per_byte']:.3f}x the tokens per "
                "held-out byte"
            )
        out_console.print(
            f"with its tokenizer on all of the corpus, as the script's: "
            f"{result['speedup_trained_on_all']:.2f}x the speed, "
            f"{whole['peak_process_bytes'] / max(base['peak_process_bytes'], 1):.2f}x the peak "
            f"of one process{per_byte}"
        )
