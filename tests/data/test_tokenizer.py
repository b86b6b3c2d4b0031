"""The BPE trainer's input: ordinary text goes to it as it is, and a run without spaces (a
genome, a blob) goes in words of at most ``WORD_CHARS`` characters, so that no line can make
training quadratic."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import gpuflow.data.tokenizer as tokenizer_module
from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.data.tokenizer import EOT, WORD_CHARS, bounded_words, long_runs, train_tokenizer


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


def test_ordinary_text_trains_the_same_tokenizer_as_before(stdlib_documents):
    """The built-in corpus has no run near ``WORD_CHARS``: what the trainer learns from it is
    what it learned from the texts as they were, byte for byte."""
    texts = [d.text for d in stdlib_documents[:300]]
    assert not any(list(long_runs(text)) for text in texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    assert train_tokenizer(texts, 2000).to_str() == tokenizer.to_str()


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
