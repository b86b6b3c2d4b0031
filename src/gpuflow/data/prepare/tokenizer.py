"""Training a byte-level BPE with Hugging Face ``tokenizers`` (loading one, and the
end-of-text token every document starts with: ``gpuflow.data.tokenizer_file``).

The trainer's memory grows with its threads (each counts the words of the texts it takes in
a table of its own) and with the length of the texts it is given, so a large sample is
trained in a process of its own with at most ``TRAIN_THREADS`` threads, from texts of at most
``FEED_CHARS``, and that process's memory is gone before encoding starts (docs/decisions/047).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import suppress
from multiprocessing.connection import Connection

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpuflow.common.errors import GpuflowError, first_line
from gpuflow.common.orphans import exit_with_parent
from gpuflow.common.procmem import resident_bytes
from gpuflow.common.signals import interrupts_held, take_interrupts_in_child
from gpuflow.data.prepare.encode import usable_cores
from gpuflow.data.prepare.pieces import Cutter
from gpuflow.data.tokenizer_file import EOT, MIN_VOCAB

# The longest run without whitespace (or of whitespace) that the BPE trainer sees whole. The
# pre-tokenizer splits text at spaces, so such a run is one "word", and every merge rescans
# every word holding its pair: one word of a million characters (a genome, a blob) holds
# nearly every pair and is rescanned at each of the thousands of merges. Runs this long are
# cut into words of at most this many characters; ordinary text has none and trains as it is.
WORD_CHARS = 1024
_SPACE, _NON_SPACE = re.compile(r"\s"), re.compile(r"\S")
# Threads of the trainer, at most: each holds its own word counts until they are summed, and
# more threads than this have not trained faster where they were tried.
TRAIN_THREADS = 16
# Characters of one text given to the trainer. It keeps the words of the text each thread is
# counting, and reads its input 256 texts at a time; texts are cut where their words cannot
# change, so the words it counts, and the tokenizer, are the same as from the texts whole.
FEED_CHARS = 1 << 16
# Texts shorter than this together train in this process: starting another costs more.
CHILD_MIN_CHARS = 8 << 20
SEND_CHARS = 1 << 20  # characters sent to the trainer's process in one message
# The most memory the trainer's process may hold. Its tables grow with the distinct words of
# its texts: a sample of real text keeps well below this, one of hashes or numbers can take
# ten times as much a megabyte, and is then stopped and trained smaller (docs/decisions/047).
TRAINER_MEMORY = 3 << 29
WATCH_S = 0.05  # how often the trainer's memory is read
# The largest vocabulary prepare trains. uint32 shards would hold ids to 2**32, but the BPE
# trainer allocates about 70 bytes a token up front (4e9 tokens: a 283 GB allocation that
# aborts the process) and a model needs an embedding row a token; real vocabularies stay
# near 200,000 (GPT-4o's o200k, Gemma's 262,144): this is eight times that.
MAX_VOCAB = 1 << 21


class TrainerOverMemory(Exception):
    """The trainer's process passed ``limit`` bytes (``TRAINER_MEMORY``) and was stopped,
    ``fed`` characters into its texts (all of them, if it had them all)."""

    def __init__(self, fed: int, limit: int) -> None:
        super().__init__(f"the tokenizer's trainer passed {limit / 2**30:.3g} GiB")
        self.fed, self.limit = fed, limit


def check_vocab_size(vocab_size: int, setting: str) -> None:
    """Refuse a vocabulary prepare cannot train: below the 256 bytes and the end-of-text
    token, or past ``MAX_VOCAB``; ``setting`` is what the user set it with."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise GpuflowError(
            f"{setting} must be between {MIN_VOCAB} and {MAX_VOCAB:,} (real tokenizers hold "
            f"30,000 to 260,000 tokens), got {vocab_size:,}"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens; ``EOT`` gets id 0.

    A small corpus may stop short of ``vocab_size`` when it runs out of pairs to merge. The
    tokenizer does not depend on the number of threads or on where it was trained. Raises
    ``TrainerOverMemory`` where texts of at least ``CHILD_MIN_CHARS`` hold so many distinct
    words that training them passes ``TRAINER_MEMORY`` (smaller texts train in this process,
    within a few hundred MB whatever they hold).
    """
    if vocab_size < MIN_VOCAB:
        raise GpuflowError(
            f"vocab size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB}"
        )
    if vocab_size > MAX_VOCAB:
        raise GpuflowError(f"vocab size {vocab_size:,} is too large: at most {MAX_VOCAB:,}")
    fed = fed_texts(bounded_words(texts))
    head: list[str] = []
    chars = 0
    for text in fed:
        head.append(text)
        chars += len(text)
        if chars >= CHILD_MIN_CHARS:
            threads = min(usable_cores(), TRAIN_THREADS)
            return _train_in_child(itertools.chain(head, fed), vocab_size, threads)
    return _train(head, vocab_size)


def _untrained() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = _untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _train_in_child(texts: Iterator[str], vocab_size: int, threads: int) -> Tokenizer:
    """``_train`` in a spawned process with ``threads`` threads, fed ``texts`` through a pipe."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(
        target=_trainer_process, args=(theirs, vocab_size, threads, os.getpid()),
        name="gpuflow-bpe-trainer",
        daemon=True,
    )  # fmt: skip
    with interrupts_held():
        child.start()
    theirs.close()
    over, done = threading.Event(), threading.Event()
    watcher = threading.Thread(
        target=_watch_memory, args=(child.pid, over, done), name="gpuflow-bpe-watch", daemon=True
    )
    watcher.start()
    replied = False
    fed = 0  # characters sent
    try:
        try:
            batch: list[str] = []
            chars = 0
            for text in texts:
                batch.append(text)
                chars += len(text)
                if chars >= SEND_CHARS:
                    ours.send(batch)
                    fed, batch, chars = fed + chars, [], 0
            ours.send(batch)
            fed += chars
            ours.send(None)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it stopped reading: its reply (a line) or its end says why
        try:
            failure, result = ours.recv()
            replied = True
        except (EOFError, OSError):  # OSError: it ended part way through its reply
            done.set()
            watcher.join()  # before the child is reaped: its pid is not another's while watched
            child.join()
            if over.is_set():
                raise TrainerOverMemory(fed, TRAINER_MEMORY) from None
            raise GpuflowError(_trainer_died(child.exitcode)) from None
    finally:
        done.set()
        watcher.join()
        ours.close()
        if not replied:
            child.kill()  # an error or an interruption in this process: it is not needed
        child.join()
    if failure:
        raise GpuflowError(f"the tokenizer could not be trained: {result}")
    return Tokenizer.from_str(result)


def _watch_memory(pid: int, over: threading.Event, done: threading.Event) -> None:
    """Stop process ``pid`` (setting ``over``) once it holds more than ``TRAINER_MEMORY``;
    until ``done``. Reads Linux's /proc: elsewhere the trainer is not watched."""
    while not done.is_set():
        resident = resident_bytes(pid)
        if resident is None:
            return
        if resident > TRAINER_MEMORY:
            over.set()
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            return
        done.wait(WATCH_S)


def _trainer_process(conn: Connection, vocab_size: int, threads: int, parent: int) -> None:
    """The trainer's process: texts in, until ``None``; (failed, tokenizer JSON or why) out."""
    take_interrupts_in_child()
    exit_with_parent(parent)  # training would otherwise run on for minutes, for nobody
    # Read once, when tokenizers starts its pool of threads: in this process, in training.
    os.environ["RAYON_NUM_THREADS"] = str(threads)

    def received() -> Iterator[str]:
        while (batch := conn.recv()) is not None:
            yield from batch

    try:
        reply = (False, _train(received(), vocab_size).to_str())
    except Exception as exc:  # tokenizers raises plain Exception
        reply = (True, first_line(exc))
    conn.send(reply)
    conn.close()


def _trainer_died(exitcode: int | None) -> str:
    why = f"exit code {exitcode}"
    if exitcode == -signal.SIGKILL:
        why = "killed, as when the machine runs out of memory"
    elif exitcode is not None and exitcode < 0:
        why = f"signal {-exitcode}"
    return f"the tokenizer's trainer stopped ({why}); nothing was written"


def fed_texts(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` in pieces of at most ``FEED_CHARS`` characters where they can be cut without
    changing a word the trainer counts (a text with no such place within ``FEED_CHARS`` goes
    on whole from there)."""
    cutter = Cutter(_untrained())
    assert cutter.proven, "gpuflow's own tokenizer is one whose harmless cuts are proven"
    for text in texts:
        yield from cutter.parts(text, FEED_CHARS)


def bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` as the trainer should see them: each text whole, except that a run of more
    than ``WORD_CHARS`` characters without whitespace (or of whitespace) is cut into pieces of
    ``WORD_CHARS``, given as texts of their own (the text before the run goes with its first
    piece, the text after it with its last)."""
    for text in texts:
        start = 0
        for run_start, run_end in long_runs(text):
            for cut in range(run_start + WORD_CHARS, run_end, WORD_CHARS):
                yield text[start:cut]
                start = cut
        yield text[start:]


def long_runs(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of more than ``WORD_CHARS`` characters without whitespace, or
    of whitespace, in order. Such a run holds a whole window of ``WORD_CHARS // 2``
    characters starting at a multiple of that, so only those windows are searched, each for
    a character that ends the run: in ordinary text one is a few characters in."""
    half, end = WORD_CHARS // 2, 0
    for at in range(0, len(text) - half + 1, half):
        if at < end:
            continue  # inside the run just found
        for ender in (_SPACE, _NON_SPACE):
            if ender.search(text, at, at + half) is not None:
                continue
            # The run goes back to the last ender before the window (the window before held
            # one, or was part of the run before this one) and on to the next one after it.
            start = max(end, at - half)
            for found in ender.finditer(text, start, at):
                start = found.end()
            after = ender.search(text, at + half)
            end = after.start() if after else len(text)
            if end - start > WORD_CHARS:
                yield start, end
            break
