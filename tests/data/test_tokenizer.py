"""The BPE trainer's input: ordinary text goes to it as it is, and a run without spaces (a
genome, a blob) goes in words of at most ``WORD_CHARS`` characters, so that no line can make
training quadratic. A large sample trains in a process of its own, on capped threads, from
texts cut where no word changes: to the tokenizer the library learns from the texts whole."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import gpuflow.data.prepare.pipeline as prepare_module
import gpuflow.data.prepare.tokenizer as tokenizer_module
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.data.prepare.tokenizer import (
    WORD_CHARS,
    bounded_words,
    fed_texts,
    long_runs,
    train_tokenizer,
)
from gpuflow.data.tokenizer_file import EOT


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "bb", " ", "\n", "aaaaaa", "      ", "\t"]), max_size=80),
    st.sampled_from([2, 3, 8, 9]),
)
def test_long_runs_are_those_a_pattern_finds(pieces, word_chars):
    """The windowed search finds what the plain pattern finds (runs of more than
    ``WORD_CHARS`` non-space characters, or space characters), and the texts given to the
    trainer join to the text, each run cut into pieces of at most that."""
    text = "".join(pieces)
    old, tokenizer_module.WORD_CHARS = tokenizer_module.WORD_CHARS, word_chars
    try:
        pattern = rf"(?<!\S)\S{{{word_chars + 1},}}|(?<!\s)\s{{{word_chars + 1},}}"
        expected = [(m.start(), m.end()) for m in re.finditer(pattern, text)]
        assert list(long_runs(text)) == expected
        given_texts = list(bounded_words([text]))
    finally:
        tokenizer_module.WORD_CHARS = old
    assert "".join(given_texts) == text
    assert len(given_texts) == 1 + sum((e - s - 1) // word_chars for s, e in expected)
    runs = [run for piece in given_texts for run in re.findall(r"\S+|\s+", piece)]
    assert all(len(run) <= word_chars for run in runs)


@pytest.mark.parametrize("where", ["here", "in a process of its own, fed short texts"])
def test_ordinary_text_trains_the_same_tokenizer_as_before(stdlib_documents, monkeypatch, where):
    """The built-in corpus has no run near ``WORD_CHARS``: what the trainer learns from it is
    what the library learns from the texts as they are, byte for byte, here or in a process
    of its own fed the texts cut into hundreds of characters."""
    if where != "here":
        monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", 0)
        monkeypatch.setattr(tokenizer_module, "FEED_CHARS", 300)
    texts = [d.text for d in stdlib_documents[:300]]
    assert not any(list(long_runs(text)) for text in texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    assert train_tokenizer(texts, 2000).to_str() == tokenizer.to_str()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["ab", "c", " ", "  ", "\n", "\t", "x.y", "\n\n "]), max_size=120),
    st.sampled_from([4, 7, 16]),
)
def test_texts_are_cut_for_the_trainer_only_where_no_word_changes(pieces, feed_chars):
    """Each cut is before a space or a newline that follows a character other than
    whitespace (a word boundary of the byte-level pre-tokenizer); the pieces join to the
    text, and a piece is longer than ``FEED_CHARS`` only where no such place was found."""
    text = "".join(pieces)
    old, tokenizer_module.FEED_CHARS = tokenizer_module.FEED_CHARS, feed_chars
    try:
        fed = list(fed_texts([text]))
    finally:
        tokenizer_module.FEED_CHARS = old
    assert "".join(fed) == text
    for before, after in itertools.pairwise(fed):
        assert after[0] in " \n" and not before[-1].isspace()
    for piece in fed[:-1]:
        assert len(piece) <= feed_chars
    if len(fed[-1]) > feed_chars:  # no place to cut within reach
        assert not re.search(r"\S[ \n]", fed[-1][: feed_chars + 1])


def _children_threads(most: dict[int, int], stop: threading.Event) -> None:
    """The most threads seen in each spawned child of this process, until ``stop``."""
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            try:
                parent = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
                if parent == os.getpid() and b"spawn_main" in (entry / "cmdline").read_bytes():
                    threads = len(os.listdir(entry / "task"))
                    most[int(entry.name)] = max(most.get(int(entry.name), 0), threads)
            except (OSError, IndexError, ValueError):
                continue
        time.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_a_large_sample_trains_in_a_process_of_its_own_on_capped_threads(
    stdlib_documents, monkeypatch
):
    """The trainer's threads are the cap's, not the cores' (a host of 64 here), in the process
    that trains; a small sample trains here, starting no process."""
    texts = [d.text for d in stdlib_documents[:300]]
    monkeypatch.setattr(tokenizer_module, "usable_cores", lambda: 64)
    seen = {}
    for cap, child_min in ((5, None), (5, 0), (9, 0)):
        monkeypatch.setattr(tokenizer_module, "TRAIN_THREADS", cap)
        if child_min is not None:
            monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", child_min)
        most: dict[int, int] = {}
        stop = threading.Event()
        watch = threading.Thread(target=_children_threads, args=(most, stop))
        watch.start()
        try:
            train_tokenizer(texts, 1000)
        finally:
            stop.set()
            watch.join()
        seen[(cap, child_min)] = max(most.values(), default=0)
    assert seen[(5, None)] == 0  # no child
    # The cap's threads, the process's own and the one that watches for its parent's end
    # (the machine has fewer cores than either cap).
    assert seen[(5, 0)] == 7 and seen[(9, 0)] == 11, seen


def test_a_trainer_that_dies_is_one_line(stdlib_documents, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", 0)

    def killing(texts):
        for i, text in enumerate(texts):
            if i == 20:  # the trainer has started: kill it as the kernel does when memory ends
                for child in multiprocessing.active_children():
                    if child.name == "gpuflow-bpe-trainer":
                        child.kill()
                        child.join()
            yield text

    texts = [d.text for d in stdlib_documents[:200]] * 5
    with pytest.raises(GpuflowError, match=r"^the tokenizer's trainer stopped \(killed, as when"):
        train_tokenizer(killing(texts), 1000)
    assert not [c for c in multiprocessing.active_children() if c.name == "gpuflow-bpe-trainer"]


def test_a_line_of_a_million_letters_reaches_the_trainer_in_bounded_words():
    rng = random.Random(0)
    genome = "".join(rng.choice("ACGT") for _ in range(1 << 20))
    text = f"chromosome 1\n{genome}\nend of file"
    given_texts = list(bounded_words([text]))
    assert "".join(given_texts) == text
    longest = max(len(run) for piece in given_texts for run in piece.split())
    assert longest == WORD_CHARS and len(given_texts) == 1 + (len(genome) - 1) // WORD_CHARS
    assert given_texts[0].startswith("chromosome 1\n") and given_texts[-1].endswith("end of file")


@pytest.mark.parametrize("line", ["ACGT", " ", "="])
def test_a_long_line_without_a_space_prepares(tmp_path, line):
    """A quarter of a million characters of one run prepares in a second (as one word it kept
    the trainer busy for more than a minute at this vocabulary), and no token learned from
    it is longer than a word the trainer was given."""
    rng = random.Random(1)
    run = "".join(rng.choice(line) for _ in range(1 << 18))
    (tmp_path / "long.txt").write_text(f"header line\n{run}\n")
    summary = prepare(PrepareConfig(data=(str(tmp_path / "long.txt"),), out=str(tmp_path / "o"),
                                    vocab_size=4000))  # fmt: skip
    assert summary.documents == 1
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] > 1
    vocab = json.loads((tmp_path / "o" / "tokenizer.json").read_text())["model"]["vocab"]
    assert max(len(token) for token in vocab) <= WORD_CHARS


def _hash_lines(chars: int, seed: int = 0) -> list[str]:
    """Texts of lock-file lines, each with a distinct sha512 (the words no two texts share)."""
    import base64

    rng = random.Random(seed)
    texts, total = [], 0
    while total < chars:
        text = "\n".join(
            f'"integrity": "sha512-{base64.b64encode(rng.randbytes(64)).decode()}",'
            for _ in range(1000)
        )
        texts.append(text)
        total += len(text)
    return texts


def test_a_trainer_past_its_memory_is_stopped_and_says_how_far_it_got(
    stdlib_documents, monkeypatch
):
    """4.5 MB of hashes take the trainer's process far past 150 MiB, where the built-in
    corpus's real text (2 MB here) stays below it: the first is stopped, the second trains."""
    monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", 0)
    monkeypatch.setattr(tokenizer_module, "TRAINER_MEMORY", 150 << 20)
    hashes = _hash_lines(4_500_000)
    with pytest.raises(tokenizer_module.TrainerOverMemory) as over:
        train_tokenizer(hashes, 2000)
    assert 0 < over.value.fed <= sum(map(len, hashes))
    assert not [c for c in multiprocessing.active_children() if c.name == "gpuflow-bpe-trainer"]
    assert train_tokenizer([d.text for d in stdlib_documents], 2000).get_vocab_size() == 2000


def test_prepare_trains_a_smaller_sample_where_the_words_pass_the_trainers_memory(
    tmp_path, monkeypatch, capsys
):
    """Each try takes a quarter of what the last was given, until one fits; the tokenizer is
    the one a sample of that size trains, and the line says what happened."""
    monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", 1_000_000)
    monkeypatch.setattr(tokenizer_module, "TRAINER_MEMORY", 150 << 20)
    data = tmp_path / "lock.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _hash_lines(4_500_000)))
    sampled: list[int] = []
    real_sample = prepare_module.Corpus.sample

    def recording_sample(self, chars):
        sampled.append(chars)
        return real_sample(self, chars)

    monkeypatch.setattr(prepare_module.Corpus, "sample", recording_sample)
    summary = prepare(PrepareConfig(data=(str(data),), out=str(tmp_path / "out"), vocab_size=400))
    assert summary.documents > 0
    assert len(sampled) >= 2 and sampled[0] == 200_000_000
    assert all(later <= earlier // 4 for earlier, later in itertools.pairwise(sampled))
    err = capsys.readouterr().err
    assert "took more than 0.146 GiB" in err and "holds unusually many distinct words" in err
