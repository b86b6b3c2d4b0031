"""Validation bits per byte: each token's UTF-8 length, read from the tokenizer, and the
figure a run logs beside its validation loss, from the bytes of the validation targets."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gpuflow.data.prepare.tokenizer import train_tokenizer
from gpuflow.data.resident.batches import validation_windows
from gpuflow.data.token_bytes import byte_level_alphabet, target_bytes, token_bytes
from gpuflow.data.tokenizer_file import EOT
from gpuflow.data.tokens import TOKENIZER_FILE, TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import Ranks
from gpuflow.train.report import build_report
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.setup import build_setup
from gpuflow.train.step import StepOptions
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

# Text with characters of two, three and four bytes, often enough to be merged into tokens.
MANY_BYTES = (
    "naïve café, façade; Ελληνικά γράμματα; 日本語の文章と漢字; emoji 🙂🙂 and ✓ marks. "
    "The quick brown fox — jumps over the lazy dog… «quoted» ½ ¾ °C\n"
)


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (what ``prepare`` trains) learnt on text full of multi-byte
    characters, saved as a tokenizer.json."""
    tokenizer = train_tokenizer([MANY_BYTES * 3] * 40, vocab_size=420)
    path = tmp_path_factory.mktemp("tokenizer") / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


def test_the_alphabet_is_the_byte_level_pre_tokenizers():
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["Ġ"], alphabet["Ċ"], alphabet["a"]) == (ord(" "), ord("\n"), ord("a"))


def test_each_tokens_length_is_the_utf8_of_what_the_tokenizer_decodes_it_to(trained_tokenizer):
    tokenizer = Tokenizer.from_file(str(trained_tokenizer))
    vocab = tokenizer.get_vocab_size()
    lengths = token_bytes(trained_tokenizer, vocab + 64)  # a model's table, rounded up
    assert lengths is not None and lengths.shape == (vocab + 64,)
    assert not lengths[vocab:].any()  # no token there
    assert lengths[tokenizer.token_to_id(EOT)] == 0  # a special token stands for no text
    wide = 0
    for token_id in range(vocab):
        text = tokenizer.decode([token_id])
        if "\ufffd" in text:  # part of a character alone: checked by the sum below
            continue
        assert lengths[token_id] == len(text.encode("utf-8")), (token_id, text)
        wide += any(ord(char) > 0x7F for char in text) and len(text) < lengths[token_id]
    assert wide > 10  # merged tokens holding characters of several bytes were checked
    for text in (MANY_BYTES, "日本語🙂", "façade ✓"):
        ids = tokenizer.encode(text).ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text


def test_a_tokenizer_that_is_not_byte_level_has_no_lengths(tmp_path):
    tokenizer = Tokenizer(models.BPE())  # SentencePiece's layout: "▁" for a space
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens([EOT])
    path = tmp_path / TOKENIZER_FILE
    tokenizer.save(str(path))
    assert token_bytes(path, 512) is None


def test_target_bytes_counts_every_id_but_the_first_of_each_row():
    lengths = np.array([0, 1, 2, 3, 4])
    windows = [np.array([[4, 1, 2], [3, 0, 4]]), np.array([[1, 1, 1], [2, 3, 3]])]
    assert target_bytes(windows, lengths) == (1 + 2) + (0 + 4) + (1 + 1) + (3 + 3)


def _independent_lengths(tokenizer: Tokenizer, ids: np.ndarray) -> dict[int, int]:
    """Each id's UTF-8 length as the tokenizer decodes it; a token that is part of a
    character alone decodes to U+FFFD, so it counts the byte-level characters it is spelt
    with (one byte each)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    lengths = {}
    for token_id in map(int, np.unique(ids)):
        text = tokenizer.decode([token_id])
        if "\ufffd" in text:
            spelt = tokenizer.id_to_token(token_id)
            assert set(spelt) <= alphabet
            lengths[token_id] = len(spelt)
        else:
            lengths[token_id] = len(text.encode("utf-8"))
    return lengths


def test_a_run_logs_and_reports_the_bits_per_byte_of_its_validation_targets(prepared, workdir):
    sets = ("train.steps=4", "train.log_interval=2", "train.eval_interval=2")
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", *sets])
    result = Trainer(config, workdir / "runs" / "bpb", Device("cpu")).run()

    # The validation set, drawn again here: 2 batches of 8 windows of 33 ids.
    folder = TokenFolder.open(prepared)
    windows = validation_windows(folder.val, 8, 32, 2)
    targets = np.concatenate([w[:, 1:].ravel() for w in windows])
    assert targets.size == 2 * 8 * 32
    tokenizer = Tokenizer.from_file(str(prepared / TOKENIZER_FILE))
    lengths = _independent_lengths(tokenizer, targets)
    n_bytes = sum(lengths[int(t)] for t in targets)
    eot = tokenizer.token_to_id(EOT)
    assert lengths[eot] == 0 and eot in targets  # its loss counts; its bytes do not
    assert n_bytes > targets.size  # several bytes a token on average

    vals = [r for r in read_metrics(result.run_dir) if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    for record in vals:
        expected = record["val_loss"] * targets.size / (math.log(2) * n_bytes)
        assert record["val_bpb"] == pytest.approx(expected, rel=1e-12)
    report = build_report(config, result)
    assert report["final_val_bpb"] == vals[-1]["val_bpb"]
    assert report["best_val_bpb"] == min(r["val_bpb"] for r in vals)


def test_a_token_folder_without_a_tokenizer_measures_no_bits_per_byte(data_copy, workdir):
    (data_copy / TOKENIZER_FILE).unlink()  # as llm.c's folders are
    config = resolve_config("tiny", None, [*FAST, f"data.dir={data_copy}"])
    setup = build_setup(
        config, workdir / "runs" / "bare", Device("cpu"), StepOptions(), Ranks(), resume=False
    )
    assert setup.val_bytes is None and setup.bits_per_byte(5.0) is None
    assert setup.val_bytes_note is not None and "no tokenizer.json" in setup.val_bytes_note
