"""Corpus -> tokenizer -> train/val token shards, streamed in bounded memory on every core.

    gpuflow prepare                                        # the built-in corpus
    gpuflow prepare --data books/ --vocab-size 32000 --out data/books
    gpuflow prepare --data stories.txt --separator '<|endoftext|>' --tokenizer gpt2
    gpuflow prepare --data more/ --out data/books --append

The output folder holds tokenizer.json, train_000000.bin..., val_000000.bin... and meta.json,
and appears only when complete; an interrupted run continues where it stopped. One process
writes a folder at a time (``outfolder.OutLock``), and ``append`` changes it all at once
(``appending``). How the stages stream, the staging folder, ``force`` and ``append``:
docs/architecture/data.md (Preparing a corpus).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import DownloadColumn, TextColumn, TransferSpeedColumn
from tokenizers import Tokenizer

from gpuflow.common.atomic import write_text_atomic
from gpuflow.common.console import err_console, progress_bar
from gpuflow.common.errors import GpuflowError, InterruptedAndSaid
from gpuflow.common.oserrors import describe_os_error
from gpuflow.data.prepare.appending import AppendTarget, check_target, commit, refuse_repeats
from gpuflow.data.prepare.corpus import Corpus
from gpuflow.data.prepare.encode import ParallelEncoder, WorkerLost, default_workers, text_encoder
from gpuflow.data.prepare.formats import ReadOptions
from gpuflow.data.prepare.inputs import describe_left_out, separator_unseen
from gpuflow.data.prepare.outfolder import (
    META_FORMAT,
    OutLock,
    check_out_place,
    check_replaceable,
    clean_leftovers,
    note,
    put_back,
    sibling,
    swap_into_place,
)
from gpuflow.data.prepare.pieces import PIECE_CHARS, Cutter, Pieces
from gpuflow.data.prepare.resume import PROGRESS_FILE, State, fingerprint_of, take_over
from gpuflow.data.prepare.tokenizer import TrainerOverMemory, check_vocab_size, train_tokenizer
from gpuflow.data.shards import Shard, ShardWriter, token_dtype_for
from gpuflow.data.tokenizer_file import eot_id, load_tokenizer, vocab_bound

DEFAULT_VOCAB = 16000
# How inputs are read: meta.json keeps the first run's at its top, and each --append's in
# its entry of "appends".
READ_SETTINGS = ("separator", "text_field", "val_fraction")
DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt's shard size
DEFAULT_SAMPLE_MB = 200  # text a tokenizer is trained on, drawn evenly from the corpus
ALL_CHARS = 1 << 62  # more than any corpus holds: a sample this large (inf MB) is all of it
# Below this many bytes a corpus is encoded in this process: starting workers would cost more.
POOL_MIN_BYTES = 16 << 20


@dataclass(frozen=True)
class PrepareConfig:
    data: tuple[str, ...] = ()  # empty: the built-in corpus
    out: str = ""  # empty: data/<corpus>-v<vocab>
    vocab_size: int = DEFAULT_VOCAB
    tokenizer: str = ""  # a tokenizer.json, a folder holding one or a hub name: not trained
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    force: bool = False
    append: bool = False  # add to the token folder ``out``, with its tokenizer
    separator: str | None = None  # text files: documents between these (None: one per file)
    text_field: str = "text"  # JSON lines, Parquet, datasets
    sample_mb: float = DEFAULT_SAMPLE_MB
    workers: int = 0  # 0: a core each, as many as memory allows (encode.default_workers)

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction <= 0.5:
            raise GpuflowError(f"--val-fraction must be in (0, 0.5], got {self.val_fraction}")
        if self.shard_tokens < 1024:
            raise GpuflowError(f"--shard-tokens must be at least 1024, got {self.shard_tokens}")
        check_vocab_size(self.vocab_size, "--vocab-size")
        if not self.sample_mb > 0:  # (inf, or more than the corpus holds: all of it)
            raise GpuflowError(
                f"--tokenizer-sample-mb must be a positive number of MB, got {self.sample_mb}"
            )
        if self.workers < 0:
            raise GpuflowError(f"--workers must be >= 0 (0: every core), got {self.workers}")
        if self.append and (self.force or not self.out or not self.data):
            raise GpuflowError(
                "--append adds --data to the token folder named by --out (and never with --force)"
            )
        ReadOptions(self.separator, self.text_field)  # validates them

    @property
    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        name = "stdlib"
        if self.data:
            # The first input's name, less suffixes and anything a glob or a shell would read
            stem = re.sub(r"[^\w-]+", "-", Path(self.data[0]).name.split(".")[0]).strip("-")
            name = "stdin" if self.data[0] == "-" else stem or "corpus"
        return default_data_dir(self.vocab_size, name)

    @property
    def read_options(self) -> ReadOptions:
        return ReadOptions(self.separator, self.text_field)


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
    forced_cuts: int = 0
    appended: bool = False
    tokenizer_seconds: float = 0.0  # training the tokenizer (0: given, or the folder's own)
    encoded_tokens: int | None = None  # by this run (None: all), when it continued another

    @property
    def tokens_per_s(self) -> float:
        done = self.train_tokens + self.val_tokens
        return (done if self.encoded_tokens is None else self.encoded_tokens) / max(
            self.seconds, 1e-9
        )

    def describe(self) -> str:
        """One line for the terminal: what was written, how much, how fast."""
        documents = "document" if self.documents == 1 else "documents"
        verb = "appended to" if self.appended else "prepared"
        cuts = ""
        if self.forced_cuts:
            cuts = (
                f"; {self.forced_cuts:,} cut{'s' if self.forced_cuts > 1 else ''} inside runs of "
                f"{PIECE_CHARS:,} characters with no space or newline may have changed a token"
            )
        trained = (
            f" (the tokenizer trained in {self.tokenizer_seconds:.1f} s)"
            if self.tokenizer_seconds
            else ""
        )
        return (
            f"{verb} {self.out_dir}: {self.documents:,} {documents}, {self.train_tokens:,} "
            f"train + {self.val_tokens:,} val tokens in {self.train_shards} + {self.val_shards} "
            f"shards, vocab {self.vocab_size:,}, {self.seconds:.1f} s{trained} "
            f"({self.tokens_per_s:,.0f} tokens/s){cuts}"
        )


# ---- the run ----------------------------------------------------------------------------


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Build the token folder ``config.out_dir`` (or add to it); see the module docstring."""
    started = time.perf_counter()
    out_dir = config.out_dir
    check_out_place(out_dir)
    made = [d for d in (out_dir.parent, *out_dir.parent.parents) if not d.exists()]
    lock = OutLock(out_dir)
    try:
        try:  # the output's place, and its one writer, before anything is read or written
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except OSError as exc:
            raise GpuflowError(f"cannot write beside {out_dir}: {describe_os_error(exc)}") from None
        return _prepare(config, out_dir, started)
    finally:
        lock.release()
        for folder in made:  # what this run created for the output, if it ends without one
            with suppress(OSError):
                folder.rmdir()  # only if empty


def _prepare(config: PrepareConfig, out_dir: Path, started: float) -> PrepareSummary:
    """``prepare``, with ``out_dir``'s lock held."""
    try:
        put_back(out_dir)  # the folder a run killed while swapping it in had moved away
    except OSError as exc:
        raise GpuflowError(f"cannot write beside {out_dir}: {describe_os_error(exc)}") from None
    # Everything the command reads is checked before any work, so a refusal is immediate.
    target = check_target(out_dir, config.tokenizer) if config.append else None
    if target is None:
        check_replaceable(out_dir, config.force)
    corpus = Corpus(config.data, config.read_options)  # every input checked before writing
    read_from = corpus.identity()
    if corpus.left_out:
        err_console.print(describe_left_out(corpus.left_out))
    if target is not None:
        refuse_repeats(corpus.inputs, corpus.identity(), target)
    fingerprint = fingerprint_of(asdict(config), corpus, target)
    stage = sibling(out_dir, "staging", os.getpid())
    try:  # the output's place, checked before any long work
        state = take_over(out_dir, stage, fingerprint) if fingerprint else None
        clean_leftovers(out_dir)
        if state is None:
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir()
            state = State(fingerprint or "")
    except OSError as exc:
        raise GpuflowError(f"cannot write beside {out_dir}: {describe_os_error(exc)}") from None
    keep_stage = False
    try:
        tokenizer, trained_s = _tokenizer(config, corpus, stage, target)
        summary = _encode(config, corpus, tokenizer, stage, state, target, started)
        summary = replace(summary, tokenizer_seconds=trained_s)
        corpus.check_unchanged(read_from)
        if unseen := separator_unseen(config.separator, corpus.inputs, state.documents):
            err_console.print(unseen)
        (stage / PROGRESS_FILE).unlink(missing_ok=True)  # from here on a rerun starts afresh
        if target is not None:
            commit(stage, target, _added(summary, state, corpus, config))
            summary = replace(summary, appended=True)
        else:
            _write_meta(stage, summary, corpus, config, state)
            check_replaceable(out_dir, config.force)  # again: the folder may have changed
            swap_into_place(stage, out_dir)
    except KeyboardInterrupt:
        keep_stage = _resumable(stage, state, fingerprint)
        if keep_stage:
            note(
                f"interrupted: {state.train_shards + state.val_shards} finished shards are kept "
                f"in {stage}; run the same command again to continue from them"
            )
            raise InterruptedAndSaid from None
        raise
    except OSError as exc:  # a fault of the machine: a full disk, a file gone read-only
        keep_stage = _resumable(stage, state, fingerprint)
        if not exc.filename:
            exc.filename = str(out_dir)
        kept = _what_is_kept(keep_stage, state, stage)
        raise GpuflowError(f"prepare stopped: {describe_os_error(exc)}; {kept}") from None
    except WorkerLost:
        keep_stage = _resumable(stage, state, fingerprint)
        raise GpuflowError(
            "prepare stopped: an encoding process ended before its work was done (killed, as "
            "when the machine runs out of memory: fewer --workers take less); "
            + _what_is_kept(keep_stage, state, stage)
        ) from None
    finally:
        if not keep_stage:
            shutil.rmtree(stage, ignore_errors=True)
    return summary


def _what_is_kept(kept: bool, state: State, stage: Path) -> str:
    if not kept:
        return "nothing was written"
    return (
        f"its {state.train_shards + state.val_shards} finished shards are kept in {stage}: "
        "run the same command again to continue from them"
    )


def _resumable(stage: Path, state: State, fingerprint: str | None) -> bool:
    """Whether a rerun of the same command continues from ``stage``: it holds finished
    shards and the progress file that says how far they go."""
    finished = state.train_shards + state.val_shards > 0
    return fingerprint is not None and finished and (stage / PROGRESS_FILE).is_file()


def _added(
    summary: PrepareSummary, state: State, corpus: Corpus, config: PrepareConfig
) -> dict[str, Any]:
    """What an appending run adds to its folder's meta.json: counts, inputs, and how they
    were read (separator, text field and val fraction may differ from the folder's first)."""
    counts = ("documents", "train_tokens", "val_tokens", "train_shards", "val_shards")
    return {
        **{key: getattr(summary, key) for key in counts},
        "max_token": state.max_token,
        "inputs": corpus.identity(),
        "source": corpus.description,
        "read_with": {key: getattr(config, key) for key in READ_SETTINGS},
    }


def _tokenizer(
    config: PrepareConfig, corpus: Corpus, stage: Path, target: AppendTarget | None
) -> tuple[Tokenizer, float]:
    """The folder's own (appending: its file is linked in when the run commits), one kept by
    an interrupted run, the one given, or one trained on a sample of the corpus; saved in the
    staging folder. With the seconds spent training it (0 when none was trained)."""
    kept = stage / "tokenizer.json"
    if target is not None:
        return target.tokenizer, 0.0
    trained_s = 0.0
    if kept.is_file():
        tokenizer = load_tokenizer(kept)
    elif config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    else:
        started = time.perf_counter()
        tokenizer = _trained(config, corpus)
        trained_s = time.perf_counter() - started
    # Written here, not by tokenizers' own save, whose failures (a full disk) are no OSError.
    write_text_atomic(kept, tokenizer.to_str(pretty=True))
    return tokenizer, trained_s


def _trained(config: PrepareConfig, corpus: Corpus) -> Tokenizer:
    """A tokenizer trained on an even sample of ``corpus``: of ``config.sample_mb``, or, where
    its words take the trainer past its memory, of a quarter of what it had been given, until
    one fits (a sample small enough trains in this process, unwatched, and fits)."""
    chars = int(min(config.sample_mb * 1e6, ALL_CHARS))
    while True:
        what = "the corpus" if (corpus.total_bytes or ALL_CHARS) <= chars else (
            f"a {chars / 1e6:.3g} MB sample of the corpus"
        )  # fmt: skip
        with err_console.status(f"training a {config.vocab_size:,}-token BPE on {what}..."):
            try:
                return train_tokenizer(corpus.sample(chars), config.vocab_size)
            except TrainerOverMemory as over:
                given = min(over.fed, chars) or chars  # (0: stopped before any was sent)
                smaller, limit = max(1, given // 4), over.limit
        err_console.print(
            f"note: training the tokenizer on {what} took more than {limit / 2**30:.3g} GiB "
            "(its text holds unusually many distinct words: hashes, numbers, encoded data); "
            f"training it on a {smaller / 1e6:.3g} MB sample instead"
        )
        chars = smaller


def _encode(
    config: PrepareConfig, corpus: Corpus, tokenizer: Tokenizer, stage: Path, state: State,
    target: AppendTarget | None, started: float,
) -> PrepareSummary:  # fmt: skip
    """Encode the corpus into shards in ``stage``, continuing from ``state`` (appending: the
    new shards only, numbered after the folder's)."""
    vocab_size = vocab_bound(tokenizer)  # (its entries may be fewer: ids with gaps)
    eot = np.array([eot_id(tokenizer)], dtype=token_dtype_for(vocab_size))
    dtype = eot.dtype
    recorded = _recorded_shards(stage, state, target)
    writers = {
        split: ShardWriter(stage, split, dtype, config.shard_tokens,
                           first_index=recorded[split][0], existing=recorded[split][1])
        for split in ("train", "val")
    }  # fmt: skip
    pieces = Pieces(Cutter(text_encoder(tokenizer)), config.val_fraction)  # as it is encoded
    stream = pieces(corpus.parts())
    big = corpus.total_bytes is None or corpus.total_bytes >= POOL_MIN_BYTES
    workers = config.workers or (default_workers(tokenizer) if big else 1)
    tokens = state.train_tokens + state.val_tokens
    speed = _Speed(tokens)
    progress = progress_bar(TransferSpeedColumn(), TextColumn("{task.fields[speed]}"),
                            counter=DownloadColumn())  # fmt: skip
    try:
        saved = stage if target is None else target.path  # holds the tokenizer as a file
        with progress, ParallelEncoder(saved / "tokenizer.json", dtype, workers) as encoder:
            task = progress.add_task("tokenizing", total=corpus.total_bytes, speed="")
            for piece in itertools.islice(stream, state.pieces):  # finished before
                progress.advance(task, piece.size)
            pieces.forced_cuts = state.forced_cuts  # those cuts were counted then
            for piece, ids in encoder.encode(stream):
                writer = writers["val" if piece.val else "train"]
                if piece.starts_document:
                    writer.add(eot)
                    state.documents += 1
                writer.add(ids)
                state.pieces += 1
                if ids.size:
                    state.max_token = max(state.max_token, int(ids.max()))
                tokens += ids.size + piece.starts_document
                progress.update(task, advance=piece.size, speed=speed(tokens))
                if writers["train"].full or writers["val"].full:
                    _checkpoint(writers, state, pieces, stage)
        state.max_token = max(state.max_token, int(eot[0]) if state.documents else -1)
        for writer in writers.values():
            writer.finish()
        if target is None:
            writers = _hold_out_a_tail(writers, stage, config, dtype)
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    train, val = writers["train"].close(), writers["val"].close()
    train_tokens = sum(Shard.open(p).n_tokens for p in train)
    val_tokens = sum(Shard.open(p).n_tokens for p in val)
    if target is None and (not train_tokens or not val_tokens):
        raise GpuflowError(
            "the corpus is too small to split into train and val text; add more text"
        )
    return PrepareSummary(
        out_dir=str(config.out_dir),
        documents=state.documents,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        train_shards=len(train),
        val_shards=len(val),
        vocab_size=vocab_size,
        seconds=time.perf_counter() - started,
        forced_cuts=pieces.forced_cuts,
        encoded_tokens=tokens - speed.tokens if state.pieces and speed.tokens else None,
    )


def _recorded_shards(
    stage: Path, state: State, target: AppendTarget | None
) -> dict[str, tuple[int, list[Path]]]:
    """By split: the index of the next shard, and the shards ``state`` records as finished.
    A shard finished after the last record (the run was killed before it wrote one) is
    removed: its pieces are encoded again."""
    recorded = {}
    for split in ("train", "val"):
        first = target.next_index(split) if target else 0
        done = getattr(state, f"{split}_shards")
        recorded[split] = (
            first + done,
            [stage / f"{split}_{i:06d}.bin" for i in range(first, first + done)],
        )
    kept = {path for _, paths in recorded.values() for path in paths}
    for path in stage.glob("*_*.bin"):
        if path not in kept:
            path.unlink()
    return recorded


class _Speed:
    """Tokens per second since the run started, for the progress line."""

    def __init__(self, tokens: int) -> None:
        self.start, self.tokens = time.perf_counter(), tokens

    def __call__(self, tokens: int) -> str:
        elapsed = time.perf_counter() - self.start
        return f"{(tokens - self.tokens) / elapsed / 1e6:.2f}M tok/s" if elapsed > 1 else ""


def _checkpoint(writers: dict[str, ShardWriter], state: State, pieces: Pieces, stage: Path) -> None:
    """Finish both open shards (at a piece boundary) and record where the run stands."""
    for split, writer in writers.items():
        if writer.finish() is not None:
            setattr(state, f"{split}_shards", getattr(state, f"{split}_shards") + 1)
        setattr(state, f"{split}_tokens", getattr(state, f"{split}_tokens") + writer.total_tokens)
        writer.total_tokens = 0
    state.forced_cuts = pieces.forced_cuts
    state.save(stage)


def _hold_out_a_tail(
    writers: dict[str, ShardWriter], stage: Path, config: PrepareConfig, dtype: np.dtype
) -> dict[str, ShardWriter]:
    """Too few documents for the hash to hold one out (a single book): hold out the tail of
    the train text instead. Every document hashed to val: that text becomes the train text
    first. Returns the writers (new ones where the splits were swapped)."""
    tokens = {k: sum(Shard.open(p).n_tokens for p in w.paths) for k, w in writers.items()}
    if not tokens["train"] and tokens["val"]:
        renamed = []
        for path in writers["val"].paths:
            renamed.append(path.with_name("train" + path.name.removeprefix("val")))
            os.replace(path, renamed[-1])
        writers = {
            "train": ShardWriter(stage, "train", dtype, config.shard_tokens,
                                 first_index=len(renamed), existing=renamed),
            "val": ShardWriter(stage, "val", dtype, config.shard_tokens),
        }  # fmt: skip
        tokens = {"train": tokens["val"], "val": 0}
    if not tokens["val"] and tokens["train"] > 1:
        writers["val"].add(
            writers["train"].take_tail(max(1, int(tokens["train"] * config.val_fraction)))
        )
    return writers


# ---- the new folder's record -------------------------------------------------------------


def _write_meta(
    stage: Path, summary: PrepareSummary, corpus: Corpus, config: PrepareConfig, state: State
) -> None:
    meta = {
        "format": META_FORMAT,
        "source": corpus.description,
        "inputs": corpus.identity(),
        "token_dtype": token_dtype_for(summary.vocab_size).name,
        "max_token": state.max_token,
        "separator": config.separator,
        "text_field": config.text_field,
        "val_fraction": config.val_fraction,
        **{k: v for k, v in asdict(summary).items() if k not in ("appended", "encoded_tokens")},
    }
    write_text_atomic(stage / "meta.json", json.dumps(meta, indent=2) + "\n")
