"""prepare: corpus -> tokenizer -> shards, all or nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.data.shards import Shard, write_shard
from gpuflow.data.tokenizer import EOT, load_tokenizer, train_tokenizer
from gpuflow.data.tokens import TokenFolder
from gpuflow.errors import GpuflowError


def test_tokenizer_round_trips_text(stdlib_documents):
    texts = [d.text for d in stdlib_documents[:60]]
    tokenizer = train_tokenizer(texts, vocab_size=600)
    assert tokenizer.token_to_id(EOT) == 0
    assert tokenizer.get_vocab_size() <= 600
    sample = "Return a list of the words in the string, using sep as the delimiter. ünïcødé ✓"
    ids = tokenizer.encode(sample, add_special_tokens=False).ids
    assert len(ids) < len(sample.encode("utf-8"))  # merges learnt: fewer tokens than bytes
    assert tokenizer.decode(ids) == sample


def test_prepared_folder_matches_the_corpus(prepared, small_corpus):
    folder = TokenFolder.open(prepared)
    meta = json.loads((prepared / "meta.json").read_text())
    tokenizer = load_tokenizer(prepared / "tokenizer.json")
    assert meta["train_tokens"] == folder.train_tokens > 0
    assert meta["val_tokens"] == folder.val_tokens > 0
    n_records = len((small_corpus / "records.jsonl").read_text().splitlines())
    assert meta["documents"] == 40 + 20 + n_records
    train = np.concatenate([s.tokens for s in folder.train])
    val = np.concatenate([s.tokens for s in folder.val])
    eot = tokenizer.token_to_id(EOT)
    # Every document starts with EOT; 1 in 20 documents is held out for validation.
    assert train[0] == eot and val[0] == eot
    n_train_docs, n_val_docs = int((train == eot).sum()), int((val == eot).sum())
    assert n_train_docs + n_val_docs == meta["documents"]
    assert n_val_docs == meta["documents"] // 20
    assert int(max(train.max(), val.max())) == meta["max_token"] < meta["vocab_size"]
    # The first document decodes back to the first file's text.
    second_eot = int(np.flatnonzero(train == eot)[1])
    first_doc = tokenizer.decode(train[1:second_eot].tolist())
    assert first_doc == (small_corpus / "doc000.txt").read_text()


def test_single_document_corpus_holds_out_its_tail(tmp_path, stdlib_documents):
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(d.text for d in stdlib_documents[:30]))
    out = tmp_path / "book"
    summary = prepare(
        PrepareConfig(data=(str(book),), out=str(out), vocab_size=400, val_fraction=0.1)
    )
    total = summary.train_tokens + summary.val_tokens
    assert summary.documents == 1
    assert summary.val_tokens == int(total * 0.1)


def test_small_shards_and_a_reused_tokenizer(tmp_path, prepared, small_corpus):
    out = tmp_path / "resharded"
    summary = prepare(
        PrepareConfig(
            data=(str(small_corpus),),
            out=str(out),
            tokenizer=str(prepared / "tokenizer.json"),
            shard_tokens=5000,
        )
    )
    assert summary.train_shards > 2
    assert (out / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
    original = TokenFolder.open(prepared)
    resharded = TokenFolder.open(out)
    np.testing.assert_array_equal(
        np.concatenate([s.tokens for s in resharded.train]),
        np.concatenate([s.tokens for s in original.train]),
    )
    assert all(s.n_tokens == 5000 for s in resharded.train[:-1])


def test_existing_output_is_kept_without_force(tmp_path, small_corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(GpuflowError, match="already exists; pass --force"):
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), vocab_size=300))
    assert (out / "precious.txt").read_text() == "keep me"


def test_a_bad_file_midway_writes_nothing(tmp_path, small_corpus):
    bad = tmp_path / "mixed"
    bad.mkdir()
    (bad / "a.txt").write_text((small_corpus / "doc000.txt").read_text())
    (bad / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    out = tmp_path / "out"
    with pytest.raises(GpuflowError, match=r"b\.txt is not UTF-8"):
        prepare(PrepareConfig(data=(str(bad),), out=str(out), vocab_size=300))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed"]


def test_force_replaces_a_folder_only_once_the_new_one_is_whole(tmp_path, small_corpus, prepared):
    out = tmp_path / "out"
    prepare(PrepareConfig(data=(str(small_corpus / "notes"),), out=str(out), vocab_size=300))
    old_meta = (out / "meta.json").read_text()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff" * 10)
    with pytest.raises(GpuflowError):
        prepare(PrepareConfig(data=(str(bad),), out=str(out), vocab_size=300, force=True))
    assert (out / "meta.json").read_text() == old_meta
    prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), vocab_size=300, force=True))
    assert (out / "meta.json").read_text() != old_meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "out"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_fraction": 0.0}, "val-fraction"),
        ({"vocab_size": 100}, "vocab-size"),
        ({"shard_tokens": 10}, "shard-tokens"),
    ],
)
def test_impossible_settings_are_refused(kwargs, message):
    with pytest.raises(GpuflowError, match=message):
        PrepareConfig(**kwargs)


def test_token_ids_beyond_the_model_vocab_are_refused(data_copy):
    folder = TokenFolder.open(data_copy)
    with pytest.raises(GpuflowError, match=r"model.vocab_size is 100; set model.vocab_size"):
        folder.check_vocab(100)
    folder.check_vocab(folder.max_token + 1)


def test_foreign_shards_are_scanned_for_their_largest_id(data_copy):
    (data_copy / "meta.json").unlink()
    shard = Shard.open(next(data_copy.glob("val_*.bin")))
    tokens = np.array(shard.tokens)
    tokens[3] = 9000
    write_shard(shard.path, tokens)
    assert TokenFolder.open(data_copy).max_token == 9000
