"""Corpus -> tokenizer -> train/val token shards, built in a staging folder and renamed into place.

    gpuflow prepare                           # the built-in corpus, 16000-token BPE
    gpuflow prepare --data books/ --vocab-size 32000 --out data/books

The output folder holds ``tokenizer.json``, ``train_000000.bin``..., ``val_000000.bin``... and
``meta.json``. It appears only when complete: a failure part-way leaves the old folder (or
none) and no partial files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.progress import DownloadColumn, TransferSpeedColumn

from gpuflow.atomic import fsync_dir, write_text_atomic
from gpuflow.console import err_console, progress_bar
from gpuflow.data.corpus import Document, default_corpus, iter_documents, resolve_corpus_files
from gpuflow.data.shards import ShardWriter, token_dtype_for
from gpuflow.data.tokenizer import eot_id, load_tokenizer, train_tokenizer
from gpuflow.errors import GpuflowError

META_FORMAT = "gpuflow-tokens-1"
DEFAULT_VOCAB = 16000
DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt's shard size
ENCODE_BATCH_CHARS = 4 << 20  # characters handed to the tokenizer's thread pool at once


@dataclass(frozen=True)
class PrepareConfig:
    data: tuple[str, ...] = ()  # empty: the built-in corpus
    out: str = ""  # empty: data/<corpus>-v<vocab>
    vocab_size: int = DEFAULT_VOCAB
    tokenizer: str = ""  # a tokenizer.json to reuse instead of training one
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    force: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction <= 0.5:
            raise GpuflowError(f"--val-fraction must be in (0, 0.5], got {self.val_fraction}")
        if self.shard_tokens < 1024:
            raise GpuflowError(f"--shard-tokens must be at least 1024, got {self.shard_tokens}")
        if not 257 <= self.vocab_size <= 1 << 32:
            raise GpuflowError(f"--vocab-size must be between 257 and 2**32, got {self.vocab_size}")

    @property
    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        return default_data_dir(self.vocab_size, Path(self.data[0]).stem if self.data else "stdlib")


def default_data_dir(vocab_size: int, corpus_name: str = "stdlib") -> Path:
    return Path("data") / f"{corpus_name}-v{vocab_size}"


@dataclass(frozen=True)
class PrepareSummary:
    out_dir: str
    documents: int
    train_tokens: int
    val_tokens: int
    train_shards: int
    val_shards: int
    vocab_size: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return (self.train_tokens + self.val_tokens) / max(self.seconds, 1e-9)


class _Corpus:
    """The documents to tokenize, readable more than once (tokenizer training, then encoding)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        if paths:
            self.files = resolve_corpus_files(list(paths))
            self._documents: list[Document] | None = None
            self.total_chars = sum(p.stat().st_size for p in self.files)
            self.description = ", ".join(str(p) for p in paths)
        else:
            self.files = []
            self._documents = default_corpus()
            self.total_chars = sum(len(d.text) for d in self._documents)
            self.description = f"built-in (Python {sys.version.split()[0]} docs and docstrings)"

    def documents(self) -> Iterator[Document]:
        if self._documents is not None:
            return iter(self._documents)
        return iter_documents(self.files)


def _text_batches(documents: Iterator[Document]) -> Iterator[tuple[list[str], int]]:
    """Documents grouped into batches of about ``ENCODE_BATCH_CHARS``, with their size."""
    batch: list[str] = []
    size = 0
    for doc in documents:
        batch.append(doc.text)
        size += len(doc.text)
        if size >= ENCODE_BATCH_CHARS:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Build the token folder ``config.out_dir``; see the module docstring."""
    started = time.perf_counter()
    out_dir = config.out_dir
    if out_dir.exists() and not config.force:
        raise GpuflowError(
            f"{out_dir} already exists; pass --force to rebuild it or --out to write elsewhere"
        )
    corpus = _Corpus(config.data)  # validates every input file before anything is written

    if config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    else:
        with err_console.status(f"training a {config.vocab_size}-token byte-level BPE..."):
            tokenizer = train_tokenizer((d.text for d in corpus.documents()), config.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    eot = eot_id(tokenizer)
    dtype = token_dtype_for(vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = out_dir.with_name(f".{out_dir.name}.staging-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        train = ShardWriter(stage, "train", dtype, config.shard_tokens)
        val = ShardWriter(stage, "val", dtype, config.shard_tokens)
        every = max(2, round(1 / config.val_fraction))
        n_docs = 0
        max_token = -1
        progress = progress_bar(TransferSpeedColumn(), counter=DownloadColumn())
        with progress:
            task = progress.add_task("tokenizing", total=corpus.total_chars)
            for texts, chars in _text_batches(corpus.documents()):
                for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                    ids = np.asarray([eot, *encoding.ids], dtype=dtype)
                    max_token = max(max_token, int(ids.max()))
                    # Every k-th document is held out, so val text is disjoint from train text.
                    (val if n_docs % every == every - 1 else train).add(ids)
                    n_docs += 1
                progress.advance(task, chars)
        if val.total_tokens == 0:
            # Too few documents to hold one out (say, a single book): hold out the tail.
            val.add(train.take_tail(max(1, int(train.total_tokens * config.val_fraction))))
        train_paths, val_paths = train.close(), val.close()
        if not train_paths:
            raise GpuflowError(
                "the corpus is too small to split into train and val text; add more text"
            )

        tokenizer.save(str(stage / "tokenizer.json"))
        summary = PrepareSummary(
            out_dir=str(out_dir),
            documents=n_docs,
            train_tokens=train.total_tokens,
            val_tokens=val.total_tokens,
            train_shards=len(train_paths),
            val_shards=len(val_paths),
            vocab_size=vocab_size,
            seconds=time.perf_counter() - started,
        )
        meta = {
            "format": META_FORMAT,
            "source": corpus.description,
            "token_dtype": dtype.name,
            "max_token": max_token,
            **asdict(summary),
        }
        write_text_atomic(stage / "meta.json", json.dumps(meta, indent=2) + "\n")
        _swap_into_place(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return summary


def _swap_into_place(stage: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with ``stage``; the old folder stays until the new one is there."""
    retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, retired)
    os.replace(stage, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(retired, ignore_errors=True)
