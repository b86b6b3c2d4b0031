"""Long documents cut into pieces where their tokens cannot change: checked against encoding
whole documents of real text, with gpuflow's tokenizer, a GPT-2-shaped one and one of
another kind; forced cuts only in runs without a space; the held-out choice per document."""

from __future__ import annotations

import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from gpuflow.data.prepare.encode import ParallelEncoder
from gpuflow.data.prepare.formats import Part
from gpuflow.data.prepare.pieces import Cutter, Pieces, byte_level_gpt2, held_out
from gpuflow.data.prepare.tokenizer import train_tokenizer
from gpuflow.data.tokenizer_file import EOT

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer(stdlib_documents) -> Tokenizer:
    return train_tokenizer((d.text for d in stdlib_documents[:300]), 3000)


@pytest.fixture(scope="module")
def tokenizer_file(tokenizer, tmp_path_factory) -> Path:
    """``tokenizer`` saved, as the encoder's workers load it."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def other_kind(stdlib_documents) -> Tokenizer:
    """Not byte-level: a normalizer and a whitespace-and-punctuation pre-tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]", EOT])
    tok.train_from_iterator((d.text for d in stdlib_documents[:200]), trainer)
    return tok


def real_texts(stdlib_documents) -> list[str]:
    """Text nobody here wrote: Python sources, its documentation, and a mix of scripts,
    line breaks and spacing."""
    sources = [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:40]]
    docs = "\n\n".join(d.text for d in stdlib_documents[300:420])
    mixed = "naïve café — 東京 \u2028 \u00a0nbsp\tTab\r\nCRLF   many   spaces\n\n\n" * 60
    return [*sources, docs, mixed]


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("which", ["tokenizer", "gpt2_shaped", "other_kind"])
def test_pieces_encode_to_the_tokens_of_the_whole_document(request, stdlib_documents, which):
    tok = request.getfixturevalue(which)
    assert byte_level_gpt2(tok) is (which != "other_kind")
    checked = 0
    for piece_chars in (150, 1000, 6000):
        for text in real_texts(stdlib_documents):
            pieces = Pieces(Cutter(tok), 0.05, piece_chars=piece_chars)
            cut = list(pieces([Part(text, True, len(text.encode("utf-8")))]))
            assert "".join(p.text for p in cut) == text
            assert all(len(p.text) <= piece_chars for p in cut)
            if pieces.forced_cuts:  # a run of piece_chars without a space: may differ there
                continue
            assert [i for p in cut for i in ids(tok, p.text)] == ids(tok, text)
            checked += len(cut) - 1
    assert checked > (2000 if which != "other_kind" else 200)  # cuts checked, not skipped


def test_pythons_whitespace_holds_the_tokenizers(tokenizer):
    """The cut rule asks Python whether ``text[i - 1]`` is whitespace; the pre-tokenizer's
    regex uses Unicode's White_Space, which Python's ``isspace`` must include."""
    white_space = [*map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680])]
    white_space += [
        chr(c) for c in [*range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
    ]
    assert all(c.isspace() for c in white_space)
    for c in white_space:  # and the pre-tokenizer does split at each of them
        assert len(tokenizer.pre_tokenizer.pre_tokenize_str(f"ab{c}cd")) > 1, hex(ord(c))
    assert unicodedata.category(" ") == "Zs"


def test_a_run_with_no_space_is_cut_at_the_limit_and_counted(tokenizer):
    pieces = Pieces(Cutter(tokenizer), 0.05, piece_chars=1000)
    text = "x" * 2500 + " tail"
    cut = list(pieces([Part(text, True, len(text))]))
    assert [len(p.text) for p in cut] == [1000, 1000, 505]
    assert pieces.forced_cuts == 2 and "".join(p.text for p in cut) == text


def test_documents_keep_their_boundaries_and_bytes(tokenizer):
    parts = [Part("first doc", True, 9), Part("second ", True, 7), Part("doc goes on", False, 11),
             Part("", False, 3), Part("third", True, 5)]  # fmt: skip
    cut = list(Pieces(Cutter(tokenizer), 0.5)(iter(parts)))
    assert [(p.text, p.starts_document) for p in cut] == [
        ("first doc", True), ("second doc goes on", True), ("third", True)
    ]  # fmt: skip
    assert sum(p.size for p in cut) == 35
    long = [Part("word " * 300, True, 1500)]
    cut = list(Pieces(Cutter(tokenizer), 0.5, piece_chars=200)(iter(long)))
    assert [p.starts_document for p in cut] == [True] + [False] * (len(cut) - 1)
    assert len({p.val for p in cut}) == 1  # a document goes one way, all of it


def test_held_out_documents_are_chosen_by_their_text_alone():
    texts = [f"document number {i} about things" for i in range(20000)]
    chosen = {t for t in texts if held_out(t, 0.05)}
    assert 0.04 < len(chosen) / len(texts) < 0.06
    assert chosen == {t for t in reversed(texts) if held_out(t, 0.05)}  # order plays no part
    assert {t for t in texts if held_out(t, 0.1)} >= chosen  # a larger share holds these too


def test_the_encoders_ids_are_the_same_on_one_core_and_on_workers(
    tokenizer, tokenizer_file, stdlib_documents
):
    texts = real_texts(stdlib_documents)[:12]
    parts = [Part(t, True, len(t)) for t in texts]
    results = []
    for workers in (1, 2):
        pieces = Pieces(Cutter(tokenizer), 0.05, piece_chars=3000)
        with ParallelEncoder(tokenizer_file, np.dtype("<u2"), workers) as encoder:
            results.append([(p.text, i) for p, i in encoder.encode(pieces(iter(parts)))])
    (one, two) = results
    assert [t for t, _ in one] == [t for t, _ in two]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(one, two, strict=True))
    whole = np.concatenate([np.array(ids(tokenizer, t), dtype="<u2") for t in texts])
    np.testing.assert_array_equal(np.concatenate([i for _, i in one]), whole)
