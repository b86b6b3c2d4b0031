"""Corpus -> tokenizer -> train/val token shards, built in a staging folder and renamed into place.

    gpuflow prepare                           # the built-in corpus, 16000-token BPE
    gpuflow prepare --data books/ --vocab-size 32000 --out data/books

The output folder holds ``tokenizer.json``, ``train_000000.bin``..., ``val_000000.bin``... and
``meta.json``. It appears only when complete: a failure part-way leaves the old folder (or
none) and no partial files. ``--force`` replaces only a folder that ``prepare`` wrote and that
holds nothing else, so a mistyped ``--out`` cannot delete the user's own files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.progress import DownloadColumn, TransferSpeedColumn

from gpuflow.common.atomic import fsync_dir, write_text_atomic
from gpuflow.common.console import err_console, progress_bar
from gpuflow.common.errors import GpuflowError
from gpuflow.data.corpus import Document, default_corpus, iter_documents, resolve_corpus_files
from gpuflow.data.shards import ShardWriter, token_dtype_for
from gpuflow.data.tokenizer import eot_id, load_tokenizer, train_tokenizer

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

    def describe(self) -> str:
        """One line for the terminal: what was written, how much, how fast."""
        documents = "document" if self.documents == 1 else "documents"
        return (
            f"prepared {self.out_dir}: {self.documents:,} {documents}, {self.train_tokens:,} "
            f"train + {self.val_tokens:,} val tokens in {self.train_shards} + {self.val_shards} "
            f"shards, vocab {self.vocab_size:,}, {self.seconds:.1f} s "
            f"({self.tokens_per_s:,.0f} tokens/s)"
        )


class _Corpus:
    """The documents to tokenize, readable more than once (tokenizer training, then encoding)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        # total_bytes is the sum of the documents' sizes: the source bytes they are read from.
        if paths:
            self.files = resolve_corpus_files(list(paths))
            self._documents: list[Document] | None = None
            self.total_bytes = sum(p.stat().st_size for p in self.files)
            self.description = ", ".join(str(p) for p in paths)
        else:
            self.files = []
            self._documents = default_corpus()
            self.total_bytes = sum(d.size for d in self._documents)
            self.description = f"built-in (Python {sys.version.split()[0]} docs and docstrings)"

    def documents(self) -> Iterator[Document]:
        if self._documents is not None:
            return iter(self._documents)
        return iter_documents(self.files)


def _text_batches(documents: Iterator[Document]) -> Iterator[tuple[list[str], int]]:
    """Documents grouped into batches of about ``ENCODE_BATCH_CHARS``, with their source bytes."""
    batch: list[str] = []
    chars = size = 0
    for doc in documents:
        batch.append(doc.text)
        chars += len(doc.text)
        size += doc.size
        if chars >= ENCODE_BATCH_CHARS:
            yield batch, size
            batch, chars, size = [], 0, 0
    if batch:
        yield batch, size


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Build the token folder ``config.out_dir``; see the module docstring."""
    started = time.perf_counter()
    out_dir = config.out_dir
    _clean_leftovers(out_dir)
    _check_replaceable(out_dir, config.force)  # before any work, so a refusal is immediate
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
    stage = _sibling(out_dir, "staging", os.getpid())
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
            task = progress.add_task("tokenizing", total=corpus.total_bytes)
            for texts, size in _text_batches(corpus.documents()):
                for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                    ids = np.asarray([eot, *encoding.ids], dtype=dtype)
                    max_token = max(max_token, int(ids.max()))
                    # Every k-th document is held out, so val text is disjoint from train text.
                    (val if n_docs % every == every - 1 else train).add(ids)
                    n_docs += 1
                progress.advance(task, size)
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
        _check_replaceable(out_dir, config.force)  # again: the folder may have changed meanwhile
        _swap_into_place(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return summary


def _swap_into_place(stage: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with ``stage``; the old folder stays until the new one is there."""
    retired = _sibling(out_dir, "old", os.getpid())
    if out_dir.exists():
        os.replace(out_dir, retired)
    os.replace(stage, out_dir)
    fsync_dir(out_dir.parent)
    if os.path.lexists(retired):
        _remove_own_files(retired)


# ---- what --force may replace ----------------------------------------------------------------

# The files prepare writes into a token folder; anything else in one belongs to someone else.
_OWN_NAME = r"meta\.json|tokenizer\.json|(?:train|val)_\d{6,}\.bin"
_OWN_FILE = re.compile(_OWN_NAME)
_OWN_FILE_OR_TEMP = re.compile(rf"{_OWN_NAME}|\.(?:{_OWN_NAME})\.tmp-\d+")  # see atomic.py


def is_token_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``prepare``: its meta.json carries our format."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def _is_own(entry: Path, pattern: re.Pattern[str] = _OWN_FILE) -> bool:
    return bool(pattern.fullmatch(entry.name)) and entry.is_file() and not entry.is_symlink()


def _foreign_entries(folder: Path) -> list[str]:
    """Names in ``folder`` that prepare did not write, sorted; folders end with ``/``."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not _is_own(p))


def _check_replaceable(out_dir: Path, force: bool) -> None:
    """Refuse to write ``out_dir`` unless replacing it loses nothing that prepare did not write."""
    if not os.path.lexists(out_dir) or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return  # nothing there, or an empty folder: nothing to lose
    if Path.cwd().is_relative_to(out_dir.resolve()):
        raise GpuflowError(f"{out_dir} is the current folder or holds it; choose another --out")
    if not out_dir.is_dir() or not is_token_folder(out_dir):
        what = f"a gpuflow token folder (it has no meta.json with format {META_FORMAT})"
        if force:
            raise GpuflowError(
                f"{out_dir} is not {what} and --force replaces only those; choose another --out"
            )
        raise GpuflowError(f"{out_dir} already exists and is not {what}; choose another --out")
    foreign = _foreign_entries(out_dir)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise GpuflowError(
            f"{out_dir} is a gpuflow token folder but also holds files gpuflow did not write "
            f"({', '.join(foreign[:5])}{more}); move them out before rebuilding it with "
            "--force, or choose another --out"
        )
    if not force:
        raise GpuflowError(
            f"{out_dir} already exists; pass --force to rebuild it or --out to write elsewhere"
        )


def _remove_own_files(folder: Path) -> bool:
    """Delete what prepare wrote in ``folder``, then the folder if that emptied it.

    Returns whether the folder is gone; one holding anything else is kept, with a warning.
    """
    if folder.is_symlink():
        folder.unlink()  # the folder it points at is not ours to empty
        return True
    for entry in folder.iterdir():
        if _is_own(entry, _OWN_FILE_OR_TEMP):
            entry.unlink()
    try:
        folder.rmdir()
    except OSError:
        foreign = ", ".join(_foreign_entries(folder))
        _note(f"kept {folder}: it holds files gpuflow did not write ({foreign})")
        return False
    return True


# ---- leftovers of interrupted runs ------------------------------------------------------------


def _sibling(out_dir: Path, kind: str, pid: int) -> Path:
    """A hidden work folder beside ``out_dir``, named after it and the process that owns it."""
    return out_dir.with_name(f".{out_dir.name}.{kind}-{pid}")


def _pid_is_running(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill would end the process
        return True
    try:
        os.kill(pid, 0)  # signal 0: checks that the process exists, sends nothing
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _clean_leftovers(out_dir: Path) -> None:
    """Remove the work folders that runs killed while writing ``out_dir`` left beside it.

    Only ``.NAME.staging-PID`` and ``.NAME.old-PID`` folders whose process is gone are
    touched, and only prepare's own files in them. A run killed between its two renames
    leaves no ``out_dir`` and the previous one in ``.NAME.old-PID``: that one is put back.
    """
    if not out_dir.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(staging|old)-(\d+)")
    for entry in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or _pid_is_running(int(match[2])):
            continue
        if match[1] == "old" and not os.path.lexists(out_dir) and is_token_folder(entry):
            os.replace(entry, out_dir)
            _note(f"restored {out_dir} from {entry}, left by an interrupted run")
        elif _remove_own_files(entry):
            _note(f"removed {entry}, left by an interrupted run")


def _note(text: str) -> None:
    # Paths are printed as they are: no rich markup in them, no line breaks inside them.
    err_console.print(text, markup=False, soft_wrap=True)
