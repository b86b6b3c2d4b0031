"""prepare as a stream: the same bytes on any number of workers, memory that does not grow with
a document, an interrupted run continued, documents appended, standard input, a tokenizer
trained on a sample drawn from the whole corpus, and bad input refused with nothing written."""

from __future__ import annotations

import errno
import gzip
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import gpuflow.data.prepare.pipeline as prepare_module
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.data.tokenizer_file import EOT, load_tokenizer
from gpuflow.data.tokens import TokenFolder
from gpuflow.interface.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from gpuflow.interface.cli.main import main
from tests.helpers import FAST, child_env, gpuflow_cli


def tree(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def stream(folder, split: str) -> np.ndarray:
    return np.concatenate([np.asarray(s.tokens) for s in getattr(TokenFolder.open(folder), split)])


def corpus_of_books(folder, stdlib_documents, n_books: int = 6):
    """A folder of 'books': each many documents joined, with separators between stories."""
    folder.mkdir()
    docs = stdlib_documents[:600]
    for b in range(n_books):
        chunk = docs[b::n_books]
        (folder / f"book{b}.txt").write_text("\n<|endoftext|>\n".join(d.text for d in chunk))
    return folder


def test_the_output_is_the_same_bytes_on_one_worker_and_on_three(tmp_path, stdlib_documents):
    books = corpus_of_books(tmp_path / "books", stdlib_documents)
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        prepare(PrepareConfig(data=(str(books),), out=str(out), vocab_size=600, workers=workers,
                              separator="<|endoftext|>", shard_tokens=20000))  # fmt: skip
        outs.append(tree(out))
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) > 6
    for name in outs[0]:
        if name != "meta.json":  # which records the seconds taken
            assert outs[0][name] == outs[1][name], name


def test_a_long_document_prepares_in_bounded_memory_to_its_whole_encoding(
    tmp_path, prepared, stdlib_documents, monkeypatch
):
    """One document of 1 MB and one of 4 MB: the same peak of Python memory, held to a few
    reads, pieces and tasks (made small here so that both documents span many), and the
    tokens of encoding the whole document at once."""
    import gpuflow.data.prepare.encode as encode_module
    import gpuflow.data.prepare.formats as formats_module
    import gpuflow.data.prepare.pieces as pieces_module

    monkeypatch.setattr(formats_module, "READ_BYTES", 64 << 10)
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 64 << 10)
    monkeypatch.setattr(encode_module, "TASK_CHARS", 128 << 10)
    tokenizer = load_tokenizer(prepared / "tokenizer.json")
    text = "\n\n".join(d.text for d in stdlib_documents[::2])  # about 1 MB of real prose
    peaks = {}
    for copies in (1, 4):
        book = tmp_path / f"book{copies}.md"
        book.write_text((text + "\n\n") * copies)
        config = PrepareConfig(data=(str(book),), out=str(tmp_path / f"o{copies}"),
                               tokenizer=str(prepared), workers=1)  # fmt: skip
        tracemalloc.start()
        summary = prepare(config)
        peaks[copies] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert summary.documents == 1 and summary.forced_cuts == 0
    assert peaks[4] < 1.3 * peaks[1] and peaks[4] < 4e6, peaks
    whole = tokenizer.encode((text + "\n\n") * 4, add_special_tokens=False).ids
    out = tmp_path / "o4"
    # One document: the hash put it in one split and its tail was held out in the other.
    train, val = stream(out, "train"), stream(out, "val")
    eot = tokenizer.token_to_id(EOT)
    tokens = np.concatenate([train, val] if train[0] == eot else [val, train])
    assert tokens[0] == eot
    np.testing.assert_array_equal(tokens[1:], whole)


def _interrupt_at_checkpoint(monkeypatch, n: int, save: bool = True) -> dict[str, int]:
    """Ctrl-C at prepare's ``n``-th checkpoint, once it is saved (``save``) or before; set
    the returned ``["n"]`` far below 0 for no more."""
    saved = prepare_module._checkpoint
    calls = {"n": 0}

    def interrupting(*args):
        calls["n"] += 1
        if save or calls["n"] != n:
            saved(*args)
        if calls["n"] == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "_checkpoint", interrupting)
    return calls


def test_ctrl_c_with_shards_kept_is_said_once(tmp_path, stdlib_documents, monkeypatch, capfd):
    """Interrupted after finished shards, ``gpuflow prepare`` says what it kept and how to go
    on, and exits 130 without a second, bare "interrupted" line under it."""
    books = corpus_of_books(tmp_path / "books", stdlib_documents)
    _interrupt_at_checkpoint(monkeypatch, 2)
    argv = ["prepare", "--data", str(books), "--out", str(tmp_path / "out"),
            "--vocab-size", "600", "--shard-tokens", "20000"]  # fmt: skip
    assert main(argv) == EXIT_INTERRUPTED
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "finished shards are kept" in lines[0], err
    # interrupted before any shard was finished: nothing kept, and the CLI's own line
    _interrupt_at_checkpoint(monkeypatch, 1, save=False)
    assert main([*argv[:4], str(tmp_path / "other"), *argv[5:]]) == EXIT_INTERRUPTED
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "interrupted" in line] == ["interrupted"], err


def test_an_interrupted_run_continues_from_its_finished_shards(tmp_path, stdlib_documents,
                                                               monkeypatch, capfd):  # fmt: skip
    books = corpus_of_books(tmp_path / "books", stdlib_documents)
    config = PrepareConfig(data=(str(books),), out=str(tmp_path / "out"), vocab_size=600,
                           separator="<|endoftext|>", shard_tokens=20000)  # fmt: skip
    prepare(PrepareConfig(**{**config.__dict__, "out": str(tmp_path / "whole")}))
    calls = _interrupt_at_checkpoint(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        prepare(config)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".out.staging-")]
    assert len(kept) == 1 and not (tmp_path / "out").exists()
    assert "run the same command again to continue" in capfd.readouterr().err
    # The killed process is gone: make the folder look like it belongs to a dead one.
    dead = kept[0].with_name(".out.staging-999999")
    kept[0].rename(dead)
    calls["n"] = -100  # no more interruptions
    encoded = []
    real_encode = prepare_module.ParallelEncoder.encode

    def counting(self, pieces):
        for piece, ids in real_encode(self, pieces):
            encoded.append(piece)
            yield piece, ids

    monkeypatch.setattr(prepare_module.ParallelEncoder, "encode", counting)
    prepare(config)
    assert "continuing the interrupted prepare" in capfd.readouterr().err
    whole, resumed = tree(tmp_path / "whole"), tree(tmp_path / "out")
    assert whole.keys() == resumed.keys()
    assert all(whole[k] == resumed[k] for k in whole if k != "meta.json")
    whole_meta, resumed_meta = (json.loads(m["meta.json"]) for m in (whole, resumed))
    for key in ("documents", "train_tokens", "val_tokens", "max_token"):
        assert whole_meta[key] == resumed_meta[key], key
    total_pieces = whole_meta["documents"]  # every document fits one piece here
    assert 0 < len(encoded) < total_pieces  # only what the first run had not finished
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_an_encoding_process_killed_stops_in_one_line_and_the_run_continues(
    tmp_path, stdlib_documents, monkeypatch, capfd
):
    """A worker killed mid-run (as the kernel kills one when memory runs out) ends prepare
    with one line that says what was kept, and the same command continues from there."""
    books = corpus_of_books(tmp_path / "books", stdlib_documents)
    argv = ["prepare", "--data", str(books), "--out", str(tmp_path / "out"),
            "--vocab-size", "600", "--separator", "<|endoftext|>", "--shard-tokens", "20000",
            "--workers", "2"]  # fmt: skip
    assert main([*argv[:4], str(tmp_path / "whole"), *argv[5:]]) == 0
    saved, calls = prepare_module._checkpoint, {"n": 0}

    def killing_a_worker(*args):
        saved(*args)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)

    monkeypatch.setattr(prepare_module, "_checkpoint", killing_a_worker)
    capfd.readouterr()
    assert main(argv) == EXIT_BAD_INPUT
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "tokenizing" not in line]  # (the bar's)
    assert len(said) == 1, err
    assert "an encoding process ended" in said[0] and "finished shards are kept" in said[0]
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".out.staging-")]
    assert len(kept) == 1 and not (tmp_path / "out").exists()
    kept[0].rename(kept[0].with_name(".out.staging-999999"))  # as if its process were gone
    monkeypatch.setattr(prepare_module, "_checkpoint", saved)
    assert main(argv) == 0
    assert "continuing the interrupted prepare" in capfd.readouterr().err
    whole, resumed = tree(tmp_path / "whole"), tree(tmp_path / "out")
    assert whole.keys() == resumed.keys()
    assert all(whole[k] == resumed[k] for k in whole if k != "meta.json")


def test_appending_adds_documents_and_moves_none_between_splits(tmp_path, small_corpus):
    out = tmp_path / "tokens"
    base = (str(small_corpus / "doc*.txt"), str(small_corpus / "notes"))
    records = str(small_corpus / "records.jsonl")
    prepare(PrepareConfig(data=base, out=str(out), vocab_size=400))
    val_before, train_before = stream(out, "val"), stream(out, "train")
    # Two workers, which load the folder's own tokenizer.json; the fresh run below has one.
    summary = prepare(PrepareConfig(data=(records,), out=str(out), append=True, workers=2))
    assert summary.appended and "appended to" in summary.describe()
    meta = json.loads((out / "meta.json").read_text())
    folder = TokenFolder.open(out)
    assert meta["train_tokens"] == folder.train_tokens and meta["val_tokens"] == folder.val_tokens
    assert len(meta["inputs"]) == 61  # 40 files, 20 notes and the records
    # The old shards are untouched; with them, the new ones hold what one prepare of all the
    # inputs with the folder's tokenizer gives: every document where its hash put it.
    assert np.array_equal(stream(out, "train")[: train_before.size], train_before)
    assert np.array_equal(stream(out, "val")[: val_before.size], val_before)
    fresh = tmp_path / "fresh"
    prepare(PrepareConfig(data=(*base, records), out=str(fresh), tokenizer=str(out)))
    np.testing.assert_array_equal(stream(out, "train"), stream(fresh, "train"))
    np.testing.assert_array_equal(stream(out, "val"), stream(fresh, "val"))
    with pytest.raises(GpuflowError, match=r"records.jsonl is already in"):
        prepare(PrepareConfig(data=(records,), out=str(out), append=True))
    with pytest.raises(GpuflowError, match="--append adds --data to the token folder named"):
        PrepareConfig(data=(records,), append=True)


def test_standard_input_prepares_through_the_cli(tmp_path, small_corpus, prepared):
    text = "\n\n\n".join(p.read_text() for p in sorted((small_corpus / "notes").iterdir()))
    result = subprocess.run(
        [sys.executable, "-m", "gpuflow", "prepare", "--data", "-", "--separator", "\\n\\n\\n",
         "--tokenizer", str(prepared), "--out", "piped"],
        input=text.encode(), cwd=tmp_path, env=child_env(), capture_output=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    meta = json.loads((tmp_path / "piped" / "meta.json").read_text())
    assert meta["documents"] == len([d for d in text.split("\n\n\n") if d.strip()])
    assert meta["source"] == "-"


def test_the_tokenizer_learns_from_every_part_of_the_corpus(tmp_path, monkeypatch):
    """A sample far smaller than the corpus still draws from its start, middle and end."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    words = ["alphaword", "betaword", "gammaword"]
    for i, word in enumerate(words):
        (corpus / f"{i}.txt").write_text(" ".join(f"{word} {n}" for n in range(40000)))
    seen = []
    real_train = prepare_module.train_tokenizer

    def recording(texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(prepare_module, "train_tokenizer", recording)
    prepare(PrepareConfig(data=(str(corpus),), out=str(tmp_path / "o"), vocab_size=400,
                          sample_mb=0.2))  # fmt: skip
    sample = "".join(seen)
    assert 0.1e6 < len(sample) < 0.5e6 < sum(p.stat().st_size for p in corpus.iterdir())
    assert all(word in sample for word in words)


def test_a_tokenizer_is_taken_from_a_folder_and_gpt2_needs_a_network(
    tmp_path, prepared, small_corpus, monkeypatch
):
    out = tmp_path / "o"
    prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), tokenizer=str(prepared)))
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    import gpuflow.data.tokenizer_file as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "HUB_HOST", "hub.invalid")  # as offline
    with pytest.raises(GpuflowError, match="gpt2 is no file here and the Hugging Face hub"):
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(tmp_path / "g"), tokenizer="gpt2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_bad_input_midway_is_one_line_and_writes_nothing(tmp_path, small_corpus):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text((small_corpus / "doc000.txt").read_text())
    with gzip.open(mixed / "b.txt.gz", "wb") as f:
        f.write(b"fine text " * 50000)
    data = (mixed / "b.txt.gz").read_bytes()
    (mixed / "b.txt.gz").write_bytes(data[: len(data) // 2])
    result = gpuflow_cli("prepare", "--data", str(mixed), "--out", "out", "--vocab-size", "300",
                         cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: corpus file") and "b.txt.gz is not valid gzip" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed"]


def test_train_on_a_raw_corpus_prepares_it_once(workdir, small_corpus, capsys):
    notes = shutil.copytree(small_corpus / "notes", workdir / "notes")
    sets = [a for s in (*FAST, "train.log_interval=2") for a in ("--set", s)]
    first = gpuflow_cli("train", "--data", "notes", "--steps", "2", "--name", "a", *sets,
                        cwd=workdir)  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert "preparing notes for training into data/cache/notes-v512-" in first.stderr
    (cached,) = (workdir / "data" / "cache").iterdir()
    config = (workdir / "runs" / "a" / "config.toml").read_text()
    assert f'dir = "{(Path("data") / "cache" / cached.name).as_posix()}"' in config
    again = gpuflow_cli("train", "--data", "notes", "--steps", "2", "--name", "b", *sets,
                        cwd=workdir)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert f"training on data/cache/{cached.name}, prepared from the same files before" in (
        again.stderr
    )
    (notes / "note000.md").write_text("a changed note " * 50)
    changed = gpuflow_cli("train", "--data", "notes", "--steps", "2", "--name", "c", *sets,
                          cwd=workdir)  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    assert len(list((workdir / "data" / "cache").iterdir())) == 2
    from gpuflow.interface.cli.main import main

    assert main(["train", "--data", "notes", "--set", "data.dir=x"]) == 2
    assert "--data and data.dir (x) both name" in capsys.readouterr().err
    # Said in train's words: a tokenizer size out of range, a file named as a token folder.
    assert main(["train", "--data", "notes", "--set", "model.vocab_size=100"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size must be between 257 and" in err and "--vocab-size" not in err
    assert main(["train", "--set", "data.dir=notes/note000.md"]) == 2
    err = capsys.readouterr().err
    assert "token folder notes/note000.md is a file, not a folder" in err, err
    assert "gpuflow train --data notes/note000.md" in err


def _anon_peak(command: list[str], cwd) -> tuple[int, int]:
    """(exit status, the peak of the process's anonymous resident memory in bytes)."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        for line in status.splitlines():
            if line.startswith("RssAnon:"):
                peak = max(peak, int(line.split()[1]) * 1024)
        time.sleep(0.02)
    proc.wait()
    return proc.returncode, peak


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_streamed_path_trains_on_a_corpus_in_the_memory_of_a_small_one(workdir):
    """A token folder ten times larger (200 MB against 20 MB) costs the streamed path no more
    anonymous memory: batches are read from memory-mapped shards."""
    from tests.helpers import random_shards

    peaks = {}
    for name, tokens in (("small", 10_000_000), ("large", 100_000_000)):
        folder = workdir / name
        folder.mkdir()
        random_shards(folder, [tokens // 4] * 4, np.uint16, 512)
        (folder / "train_000000.bin").rename(folder / "val_000000.bin")
        sets = [*FAST, f"data.dir={folder}", "train.data_path=streamed", "train.eval_batches=1"]
        args = ["train", "--name", name, "--steps", "30", "--device", "cpu"]
        command = [sys.executable, "-m", "gpuflow", *args, *(a for s in sets for a in ("--set", s))]
        code, peaks[name] = _anon_peak(command, workdir)
        assert code == 0
    assert peaks["large"] < peaks["small"] + 40e6, peaks


def test_an_unwritable_output_place_is_refused_before_any_work(tmp_path, small_corpus, monkeypatch):
    (tmp_path / "afile").write_text("not a folder")

    def fail(*args, **kwargs):
        raise AssertionError("worked before refusing")

    monkeypatch.setattr(prepare_module, "train_tokenizer", fail)
    with pytest.raises(GpuflowError, match=r"cannot write beside .*afile/out"):
        prepare(PrepareConfig(data=(str(small_corpus),), out=str(tmp_path / "afile" / "out")))


def test_a_full_disk_keeps_the_finished_shards_and_says_so(tmp_path, stdlib_documents, monkeypatch):
    books = corpus_of_books(tmp_path / "books", stdlib_documents)
    config = PrepareConfig(data=(str(books),), out=str(tmp_path / "out"), vocab_size=600,
                           separator="<|endoftext|>", shard_tokens=20000)  # fmt: skip
    real_add, added = prepare_module.ShardWriter.add, {"n": 0}

    def filling(self, tokens):
        added["n"] += 1
        if added["n"] == 400:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.folder))
        real_add(self, tokens)

    monkeypatch.setattr(prepare_module.ShardWriter, "add", filling)
    with pytest.raises(GpuflowError, match=r"No space left on device .* finished shards are kept"):
        prepare(config)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.staging-")]
    assert not (tmp_path / "out").exists() and list(kept.glob("train_*.bin"))
    assert not list(kept.glob(".*.tmp-*"))  # the open shard's partial file is gone


def test_a_gpt2_shaped_tokenizer_with_its_end_of_text_last(tmp_path, small_corpus, gpt2_shaped):
    """GPT-2's layout (byte-level, <|endoftext|> added after the merges, the last id): each
    document starts with that id, and the shards are uint16 as for GPT-2's 50,257 ids."""
    tok = gpt2_shaped
    tok.save(str(tmp_path / "gpt2-like.json"))
    out = tmp_path / "o"
    prepare(PrepareConfig(data=(str(small_corpus),), out=str(out),
                          tokenizer=str(tmp_path / "gpt2-like.json")))  # fmt: skip
    eot = tok.get_vocab_size() - 1
    assert tok.token_to_id(EOT) == eot
    train = stream(out, "train")
    assert train.dtype == np.uint16 and train[0] == eot and train.max() == eot
    assert json.loads((out / "meta.json").read_text())["documents"] == int(
        (train == eot).sum() + (stream(out, "val") == eot).sum()
    )


@pytest.mark.parametrize(
    ("data", "folder"),
    [("books/", "books"), ("x.jsonl.zst", "x"), ("my data.txt", "my-data"),
     ("crawl/*.jsonl.gz", "corpus"), ("-", "stdin")],
)  # fmt: skip
def test_the_default_output_is_named_after_the_first_input(data, folder):
    assert PrepareConfig(data=(data,)).out_dir == Path("data") / f"{folder}-v16000"
