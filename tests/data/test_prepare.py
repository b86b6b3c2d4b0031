"""prepare: corpus -> tokenizer -> shards, all or nothing."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpuflow.data.prepare.pipeline as prepare_module
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.inputs import resolve_inputs
from gpuflow.data.prepare.pieces import PIECE_CHARS, held_out
from gpuflow.data.prepare.pipeline import PrepareConfig, PrepareSummary, prepare
from gpuflow.data.prepare.tokenizer import train_tokenizer
from gpuflow.data.shards import Shard, write_shard
from gpuflow.data.tokenizer_file import EOT, load_tokenizer
from gpuflow.data.tokens import TokenFolder
from gpuflow.train.config import PRESETS
from gpuflow.train.suggest import PRESET_MAX_LENS, PRESET_VOCAB_SIZES, train_command
from tests.helpers import child_env


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
    # Every document starts with EOT; a document is held out by a hash of its text.
    assert train[0] == eot and val[0] == eot
    n_train_docs, n_val_docs = int((train == eot).sum()), int((val == eot).sum())
    assert n_train_docs + n_val_docs == meta["documents"]
    assert 0 < n_val_docs < meta["documents"] // 5
    for split, held in ((train, False), (val, True)):
        for doc in np.split(split, np.flatnonzero(split == eot)[1:]):
            assert held_out(tokenizer.decode(doc[1:].tolist()), 0.05) is held
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
    # the tokenizer's training is timed apart, within the run, and the closing line says so
    assert 0 < summary.tokenizer_seconds < summary.seconds
    assert f"the tokenizer trained in {summary.tokenizer_seconds:.1f} s" in summary.describe()


@pytest.mark.parametrize("workers", [1, 2])
def test_the_boundary_token_written_in_a_document_is_encoded_as_its_text(
    tmp_path, stdlib_documents, workers
):
    """Tokenizer code and pages about one hold "<|endoftext|>" as text: it was encoded as the
    boundary token, splitting its document for the model (and its bytes counted as none)."""
    texts = [d.text for d in stdlib_documents[:40]]
    texts[3] += "\nThe separator is <|endoftext|>, then the next document."
    texts[7] = f"{EOT}{texts[7]}{EOT}"
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = tmp_path / "out"
    prepare(PrepareConfig(data=(str(tmp_path / "docs.jsonl"),), out=str(out), vocab_size=500,
                          workers=workers))  # fmt: skip
    tokenizer = load_tokenizer(out / "tokenizer.json")
    folder = TokenFolder.open(out)
    tokens = np.concatenate([s.tokens for s in (*folder.train, *folder.val)])
    eot = tokenizer.token_to_id(EOT)
    assert int((tokens == eot).sum()) == len(texts)
    docs = np.split(tokens, np.flatnonzero(tokens == eot)[1:])
    assert sorted(tokenizer.decode(d[1:].tolist()) for d in docs) == sorted(texts)


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
    assert summary.tokenizer_seconds == 0 and "trained in" not in summary.describe()
    assert (out / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
    original = TokenFolder.open(prepared)
    resharded = TokenFolder.open(out)
    np.testing.assert_array_equal(
        np.concatenate([s.tokens for s in resharded.train]),
        np.concatenate([s.tokens for s in original.train]),
    )
    # A shard closes at the end of the first piece that takes it past 5000 tokens.
    assert all(5000 <= s.n_tokens < 5000 + PIECE_CHARS for s in resharded.train[:-1])


def test_existing_output_is_kept_without_force(tmp_path, small_corpus, prepared):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    # Not a token folder: --force would be refused too, so the message must not offer it.
    with pytest.raises(GpuflowError, match="already exists and is not a gpuflow") as refused:
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), vocab_size=300))
    assert "--force" not in str(refused.value)
    assert (out / "precious.txt").read_text() == "keep me"
    tokens = shutil.copytree(prepared, tmp_path / "tokens")
    with pytest.raises(GpuflowError, match="already exists; pass --force"):
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(tokens), vocab_size=300))


def _no_tokenizing(monkeypatch):
    """Make any tokenizer training fail the test: refusals must come before the work."""

    def fail(*args, **kwargs):
        raise AssertionError("tokenized before refusing")

    monkeypatch.setattr(prepare_module, "train_tokenizer", fail)


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_force_refuses_the_corpus_folder_itself(tmp_path, small_corpus, monkeypatch):
    books = shutil.copytree(small_corpus, tmp_path / "books")
    before = _tree(books)
    _no_tokenizing(monkeypatch)
    config = PrepareConfig(data=(str(books),), out=str(books), vocab_size=300, force=True)
    with pytest.raises(GpuflowError, match=r"books is not a gpuflow token folder .*another --out"):
        prepare(config)
    assert _tree(books) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books"]


def test_force_refuses_a_folder_of_datasets(tmp_path, small_corpus, prepared, monkeypatch):
    data = tmp_path / "data"
    for name in ("first", "second"):
        shutil.copytree(prepared, data / name)
    before = _tree(data)
    _no_tokenizing(monkeypatch)
    with pytest.raises(GpuflowError, match="data is not a gpuflow token folder"):
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(data), force=True))
    assert _tree(data) == before


def test_force_keeps_a_token_folder_that_holds_files_of_its_own(
    tmp_path, small_corpus, prepared, monkeypatch
):
    out = shutil.copytree(prepared, tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    before = _tree(out)
    _no_tokenizing(monkeypatch)
    for force in (True, False):
        with pytest.raises(GpuflowError, match=r"did not write \(notes\.txt, plots/\)"):
            prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), force=force))
    assert _tree(out) == before


def test_force_checks_again_just_before_replacing(tmp_path, small_corpus, prepared, monkeypatch):
    out = shutil.copytree(prepared, tmp_path / "out")
    before = _tree(out)
    real_write = prepare_module.write_text_atomic

    def write_then_user_adds_a_file(path, text):
        real_write(path, text)
        (out / "late.txt").write_text("added while prepare ran")

    monkeypatch.setattr(prepare_module, "write_text_atomic", write_then_user_adds_a_file)
    config = PrepareConfig(data=(str(small_corpus),), out=str(out), vocab_size=300, force=True)
    with pytest.raises(GpuflowError, match=r"did not write \(late\.txt\)"):
        prepare(config)
    assert _tree(out) == {**before, (out / "late.txt").relative_to(out): b"added while prepare ran"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_empty_folder_is_filled_without_force(tmp_path, small_corpus):
    out = tmp_path / "out"
    out.mkdir()
    prepare(PrepareConfig(data=(str(small_corpus / "notes"),), out=str(out), vocab_size=300))
    assert TokenFolder.open(out).train_tokens > 0


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


def test_leftovers_of_killed_runs_are_removed(tmp_path, small_corpus, prepared):
    dead, alive = _dead_pid(), os.getppid()
    leftovers = [tmp_path / f".out.staging-{dead}", tmp_path / f".out.old-{dead}"]
    kept = [
        tmp_path / f".out.staging-{alive}",  # another run, still working
        tmp_path / f".other.staging-{dead}",  # another output's
        tmp_path / f".out.staging-{dead}.bak",  # not gpuflow's naming
        tmp_path / ".out.staging-x",
    ]
    for folder in leftovers + kept:
        shutil.copytree(prepared, folder)
    (leftovers[0] / ".train_000001.bin.tmp-123").write_bytes(b"partial")
    out = shutil.copytree(prepared, tmp_path / "out")
    prepare(PrepareConfig(data=(str(small_corpus / "notes"),), out=str(out), force=True))
    assert not any(os.path.lexists(p) for p in leftovers)
    assert all(_tree(p) == _tree(prepared) for p in kept)


def test_a_run_killed_between_its_renames_gets_its_old_folder_back(
    tmp_path, small_corpus, prepared
):
    shutil.copytree(prepared, tmp_path / f".out.old-{_dead_pid()}")
    shutil.copytree(prepared, tmp_path / f".out.staging-{_dead_pid()}")
    out = tmp_path / "out"
    notes = (str(small_corpus / "notes"),)
    with pytest.raises(GpuflowError, match="already exists; pass --force"):
        prepare(PrepareConfig(data=notes, out=str(out)))  # refused before any work
    assert _tree(out) == _tree(prepared)  # put back first
    prepare(PrepareConfig(data=notes, out=str(out), vocab_size=300, force=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the dead run's work gone


def test_progress_counts_source_bytes_to_exactly_its_total(tmp_path, small_corpus, monkeypatch):
    bars = []

    def recording_progress_bar(*args, **kwargs):
        bars.append(real_progress_bar(*args, **kwargs))
        return bars[-1]

    real_progress_bar = prepare_module.progress_bar
    monkeypatch.setattr(prepare_module, "progress_bar", recording_progress_bar)
    prepare(PrepareConfig(data=(str(small_corpus),), out=str(tmp_path / "out"), vocab_size=300))
    (task,) = bars[0].tasks
    on_disk = sum(i.size() for i in resolve_inputs([small_corpus]))
    assert task.total == task.completed == on_disk


def _summary(documents=3, vocab_size=16000, out_dir="data/books-v16000"):
    return PrepareSummary(out_dir, documents, 900, 100, 1, 1, vocab_size, 2.0)


def test_the_summary_line_counts_documents_in_good_english():
    assert "prepared data/books-v16000: 1 document, 900 train + 100 val" in _summary(1).describe()
    assert ": 3 documents, " in _summary(3).describe()
    assert ": 1,200 documents, " in _summary(1200).describe()


@pytest.mark.parametrize(
    ("vocab_size", "out_dir", "command"),
    [
        (16000, "data/books-v16000", "--preset seed-d384 --set data.dir=data/books-v16000"),
        (4096, "d", "--preset tiny --set data.dir=d"),
        (50304, "d", "--preset gpt2-124m --set data.dir=d"),
        (500, "d", "--preset tiny --set data.dir=d --set model.vocab_size=512"),
        (16001, "d", "--preset tiny --set data.dir=d --set model.vocab_size=16064"),
        (512, "my data", "--preset tiny --set 'data.dir=my data' --set model.vocab_size=512"),
    ],
)
def test_train_command_fits_the_prepared_vocabulary(vocab_size, out_dir, command):
    summary = _summary(vocab_size=vocab_size, out_dir=out_dir)
    assert train_command(summary.vocab_size, summary.out_dir) == (f"gpuflow train {command}")


@pytest.mark.parametrize(
    ("vocab_size", "command"),
    [
        (16000, "--preset tiny --set data.dir=d --set model.vocab_size=16000"),
        (50304, "--preset tiny --set data.dir=d --set model.vocab_size=50304"),
        (4096, "--preset tiny --set data.dir=d"),
    ],
)
def test_without_a_gpu_the_suggestion_is_the_tiny_preset(vocab_size, command):
    """Not a GPU preset's hours on a CPU: tiny, at the folder's vocabulary."""
    assert train_command(vocab_size, "d", gpu=False) == f"gpuflow train {command}"


def test_the_suggested_command_trains_on_the_prepared_folder(prepared):
    from gpuflow.train.config import resolve_config

    meta = json.loads((prepared / "meta.json").read_text())
    command = train_command(meta["vocab_size"], str(prepared))
    args = shlex.split(command)
    assert args[:4] == ["gpuflow", "train", "--preset", "tiny"] and args[4::2] == ["--set"] * 2
    config = resolve_config(args[3], sets=args[5::2])
    assert config.data.dir == str(prepared)
    TokenFolder.open(config.data.dir).check_vocab(config.model.vocab_size)


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
    with pytest.raises(GpuflowError, match=r"model.vocab_size is 100; train with --set model.voc"):
        folder.check_vocab(100)
    folder.check_vocab(folder.max_token + 1)


def test_foreign_shards_are_scanned_for_their_largest_id(data_copy):
    (data_copy / "meta.json").unlink()
    shard = Shard.open(next(data_copy.glob("val_*.bin")))
    tokens = np.array(shard.tokens)
    tokens[3] = 9000
    write_shard(shard.path, tokens)
    assert TokenFolder.open(data_copy).max_token == 9000


def test_the_suggestion_knows_every_presets_vocabulary_without_loading_torch(tmp_path):
    assert {name: p.model.vocab_size for name, p in PRESETS.items()} == PRESET_VOCAB_SIZES
    assert {name: p.model.max_len for name, p in PRESETS.items()} == PRESET_MAX_LENS
    code = "import sys, gpuflow.train.suggest; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
