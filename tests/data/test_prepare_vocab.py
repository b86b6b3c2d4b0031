"""The vocabulary prepare trains, the sample it trains on and the vocabulary a given tokenizer
needs: a vocabulary no trainer can hold is refused in one line before any work, a sample of
more than any corpus holds is all of it, and a tokenizer's vocabulary is its largest id + 1
(its count of entries is less where its ids have gaps), for the shards' token type, meta.json
and the train command prepare advises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import gpuflow.data.prepare.pipeline as prepare_module
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.pipeline import PrepareConfig
from gpuflow.data.prepare.tokenizer import MAX_VOCAB, train_tokenizer
from gpuflow.data.shards import Shard
from gpuflow.data.tokenizer_file import EOT, vocab_bound
from gpuflow.data.tokens import TokenFolder
from gpuflow.interface.cli.main import main
from tests.data.test_prepare_refusals import hidden, one_error

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "list", "of"]
TEXT = "\n\n".join(" ".join(WORDS[i:] + WORDS[:i]) * 8 for i in range(len(WORDS)))


def _not_trained(*args: object) -> None:
    raise AssertionError("the trainer was started")  # (4e9 tokens: it would abort pytest)


def test_a_vocabulary_no_trainer_can_hold_is_refused_before_any_work(workdir, capsys, monkeypatch):
    """4e9 was below the old bound (2**32), and the trainer's first allocation (283 GB)
    aborted the process with a Rust backtrace, leaving the lock and the staging folder."""
    monkeypatch.setattr(prepare_module, "train_tokenizer", _not_trained)
    (workdir / "a.txt").write_text(TEXT)
    code = main(["prepare", "--data", "a.txt", "--vocab-size", "4000000000"])
    line = one_error(capsys, code)
    assert f"--vocab-size must be between 257 and {MAX_VOCAB:,}" in line
    assert "got 4,000,000,000" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["a.txt"]
    with pytest.raises(GpuflowError, match="--vocab-size must be between"):
        PrepareConfig(vocab_size=MAX_VOCAB + 1)
    with pytest.raises(GpuflowError, match=f"at most {MAX_VOCAB:,}"):
        train_tokenizer([TEXT], MAX_VOCAB + 1)


def test_the_largest_vocabulary_allowed_trains():
    """The bound is one the trainer holds (a small text stops short of it, out of pairs)."""
    PrepareConfig(vocab_size=MAX_VOCAB)
    assert 257 < train_tokenizer([TEXT], MAX_VOCAB).get_vocab_size() < 1000


@pytest.mark.parametrize("huge", ["inf", "1e308"])
def test_a_sample_of_more_than_any_number_is_all_of_the_corpus(workdir, huge):
    """1e308 MB is no number of characters (int(inf) raised OverflowError): the tokenizer is
    the one trained on all of the corpus."""
    (workdir / "a.txt").write_text(TEXT)
    command = ["prepare", "--data", "a.txt", "--vocab-size", "300", "--out", "tokens"]
    assert main([*command, "--tokenizer-sample-mb", huge]) == 0
    whole = train_tokenizer([TEXT], 300).to_str(pretty=True)
    assert (workdir / "tokens" / "tokenizer.json").read_text() == whole


@pytest.mark.parametrize("given", ["nan", "0", "-1"])
def test_a_sample_of_no_positive_size_is_one_line(workdir, capsys, given):
    (workdir / "a.txt").write_text(TEXT)
    code = main(["prepare", "--data", "a.txt", "--tokenizer-sample-mb", given])
    line = one_error(capsys, code)
    assert "--tokenizer-sample-mb must be a positive number of MB, got" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["a.txt"]


def _word_level(largest: int) -> Tokenizer:
    """A WordLevel tokenizer of 13 entries, numbered 0 to 11 and ``largest`` ("list")."""
    vocab = {word: i for i, word in enumerate(w for w in WORDS if w != "list")}
    vocab.update({"[UNK]": len(vocab), EOT: len(vocab) + 1, "list": largest})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _largest_id(folder: Path) -> int:
    return max(Shard.open(path).max_token() for path in folder.glob("*.bin"))


@pytest.mark.parametrize(("largest", "dtype"), [(600, "uint16"), (70_000, "uint32")])
def test_a_tokenizer_whose_ids_have_gaps_is_sized_by_its_largest_id(
    workdir, capsys, largest, dtype
):
    """By its 13 entries, uint16 shards, which 70,000 overflowed (OverflowError), and a
    vocabulary of 13 (model.vocab_size=64 advised), which train refused id 600 against."""
    tokenizer = _word_level(largest)
    assert (tokenizer.get_vocab_size(), vocab_bound(tokenizer)) == (13, largest + 1)
    tokenizer.save(str(workdir / "wl.json"))
    (workdir / "a.txt").write_text(TEXT)
    command = ["prepare", "--data", "a.txt", "--tokenizer", "wl.json", "--out", "tokens"]
    assert main(command) == 0
    advised = -(-(largest + 1) // 64) * 64
    assert f"--set model.vocab_size={advised}" in capsys.readouterr().out
    meta = json.loads((workdir / "tokens" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["token_dtype"], meta["max_token"]) == (
        largest + 1, dtype, largest,
    )  # fmt: skip
    assert {Shard.open(p).dtype.name for p in (workdir / "tokens").glob("*.bin")} == {dtype}
    assert _largest_id(workdir / "tokens") == largest
    # --append checks the folder's tokenizer against meta.json by the same measure
    (workdir / "more.txt").write_text("a list of lists " * 40)
    assert main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"]) == 0
    assert hidden(workdir) == []
    # and train opens it by the same measure: the advised table takes every id
    folder = TokenFolder.open(workdir / "tokens")
    assert folder.vocab == largest + 1
    folder.check_vocab(advised)
