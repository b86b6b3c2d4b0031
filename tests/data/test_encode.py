"""The encoding workers' memory: each runs ``tokenizers`` on one thread and loads no numpy, a
long piece is encoded a bounded batch at a time to the ids of the whole, and the default
number of workers is what their memory allows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

import gpuflow.data.prepare.encode as encode_module
from gpuflow.data.prepare.encode import IdEncoder, ParallelEncoder, default_workers
from gpuflow.data.prepare.pieces import Piece
from gpuflow.data.prepare.tokenizer import train_tokenizer
from gpuflow.data.tokenizer_file import EOT


@pytest.fixture(scope="module")
def tokenizer(stdlib_documents) -> Tokenizer:
    return train_tokenizer((d.text for d in stdlib_documents[:300]), 2000)


@pytest.fixture(scope="module")
def tokenizer_file(tokenizer, tmp_path_factory) -> Path:
    """``tokenizer`` saved, as the encoder's workers load it."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def long_text(stdlib_documents) -> str:
    return "\n\n".join(d.text for d in stdlib_documents[:60])


def spawned_children() -> list[int]:
    """This process's children started by multiprocessing's spawn (workers, trackers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_each_worker_encodes_on_one_thread_without_numpy(
    tokenizer, tokenizer_file, stdlib_documents
):
    """tokenizers starts a pool of one thread a core in any process that encodes a batch
    (more than the two threads checked here on any host of two cores or more),
    and numpy one for its BLAS: a worker is a core already, and every thread holds memory."""
    text = long_text(stdlib_documents)
    pieces = [Piece(text, True, False, len(text))] * 6
    with ParallelEncoder(tokenizer_file, np.dtype("<u2"), 2) as encoder:
        encoded = [ids for _, ids in encoder.encode(iter(pieces))]
        workers = spawned_children()
        threads = {pid: len(os.listdir(f"/proc/{pid}/task")) for pid in workers}
        numpy_loaded = {pid: "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
                        for pid in workers}  # fmt: skip
    assert len(workers) >= 2  # the two workers (and the tracker of their semaphores)
    # The one that encodes, and one that watches for the parent's end (common/orphans.py).
    assert set(threads.values()) == {2}, threads
    assert not any(numpy_loaded.values()), numpy_loaded
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert all(ids.tolist() == whole for ids in encoded)


def test_a_long_piece_is_encoded_a_batch_at_a_time_to_the_ids_of_the_whole(
    tokenizer, stdlib_documents
):
    text = long_text(stdlib_documents)
    texts = [text, "a short one", text[: len(text) // 3]]
    encoder = IdEncoder(tokenizer, 2, batch_chars=4096)
    batches: list[int] = []
    real = encoder._encode

    def recording(batch, **kwargs):
        batches.append(sum(len(t) for t in batch))
        return real(batch, **kwargs)

    encoder._encode = recording
    ids, counts = encoder(texts)
    wholes = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert counts == [len(w) for w in wholes]
    assert ids.tolist() == [i for w in wholes for i in w]
    # A batch closes once it holds 4096 characters: less than twice that, a part being at most
    # 4096; the long text went in many.
    assert max(batches) < 2 * 4096 and len(batches) > len(text) // (2 * 4096)


def test_a_tokenizer_whose_cuts_are_not_proven_encodes_each_text_whole(stdlib_documents):
    other = Tokenizer(models.BPE(unk_token="[UNK]"))
    other.normalizer = normalizers.NFKC()
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["[UNK]", EOT])
    other.train_from_iterator((d.text for d in stdlib_documents[:100]), trainer)
    text = long_text(stdlib_documents)
    ids, counts = IdEncoder(other, 2, batch_chars=4096)([text])
    assert ids.tolist() == other.encode(text, add_special_tokens=False).ids == ids.tolist()
    assert counts == [len(ids)]


def test_the_default_workers_are_as_many_as_their_memory_allows(tokenizer, monkeypatch):
    each = encode_module.WORKER_BYTES + encode_module.TOKENIZER_MEMORY_PER_JSON_BYTE * len(
        tokenizer.to_str()
    )
    assert default_workers(tokenizer, cores=4) == 4
    monkeypatch.setattr(encode_module, "WORKERS_MEMORY", 3 * each + each // 2)
    assert default_workers(tokenizer, cores=64) == 3
    assert default_workers(tokenizer, cores=2) == 2
    monkeypatch.setattr(encode_module, "WORKERS_MEMORY", each // 2)
    assert default_workers(tokenizer, cores=64) == 1
