"""prepare with its memory bounds all in play (the tokenizer trained in a process of its own
from short texts, long documents encoded by workers a small batch at a time) writes what
the library alone gives: the tokenizer it learns from the sample, and each document's ids
after the end-of-text token, in order, in the split its hash chose."""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import gpuflow.data.prepare.encode as encode_module
import gpuflow.data.prepare.tokenizer as tokenizer_module
from gpuflow.data.prepare.corpus import Corpus
from gpuflow.data.prepare.formats import ReadOptions
from gpuflow.data.prepare.pieces import held_out
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.data.prepare.tokenizer import long_runs
from gpuflow.data.tokenizer_file import EOT
from gpuflow.data.tokens import TokenFolder


def library_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """What a user's script learns from ``texts`` with the library (gpuflow's settings)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def test_the_bounded_prepare_writes_what_the_library_gives(tmp_path, stdlib_documents, monkeypatch):
    texts = [d.text for d in stdlib_documents[:400]]
    texts += ["\n\n".join(texts[i : i + 40]) for i in range(0, 200, 40)]  # long documents
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.setattr(tokenizer_module, "CHILD_MIN_CHARS", 0)
    monkeypatch.setattr(tokenizer_module, "FEED_CHARS", 2000)
    monkeypatch.setattr(encode_module, "BATCH_CHARS", 3000)
    monkeypatch.setattr(encode_module, "TASK_CHARS", 20000)
    config = PrepareConfig(data=(str(corpus),), out=str(tmp_path / "out"), vocab_size=700,
                           workers=2)  # fmt: skip
    summary = prepare(config)
    assert summary.documents == len(texts) and summary.forced_cuts == 0

    sample = list(Corpus(config.data, ReadOptions()).sample(int(config.sample_mb * 1e6)))
    assert not any(list(long_runs(t)) for t in sample)  # the trainer takes them as they are
    expected = library_tokenizer(sample, config.vocab_size)
    written = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert written.to_str() == expected.to_str()

    eot = expected.token_to_id(EOT)
    streams: dict[bool, list[int]] = {False: [], True: []}
    for text in texts:  # each shorter than a piece: the document is its first piece
        streams[held_out(text, config.val_fraction)] += [eot, *expected.encode(text).ids]
    folder = TokenFolder.open(tmp_path / "out")
    for split, val in (("train", False), ("val", True)):
        tokens = np.concatenate([np.asarray(s.tokens) for s in getattr(folder, split)])
        np.testing.assert_array_equal(tokens, np.array(streams[val], dtype=tokens.dtype))
