"""The token folder a run trains on when it is given no prepared one: the built-in corpus or
the user's raw files, prepared on first use and reused after.

    folder = prepared_for_training(16000)                        # data/stdlib-v16000
    folder = prepared_for_training(16000, data=("books/",))      # data/cache/books-v16000-<key>

It writes: the first call for a corpus runs ``prepare`` into the folder; later calls find it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.inputs import resolve_inputs
from gpuflow.data.prepare.outfolder import FolderBusy, OutLock, is_token_folder, note
from gpuflow.data.prepare.pieces import PIECE_CHARS
from gpuflow.data.prepare.pipeline import PrepareConfig, default_data_dir, prepare
from gpuflow.data.prepare.tokenizer import check_vocab_size

CACHE_DIR = Path("data") / "cache"


def prepared_for_training(
    vocab_size: int, data: tuple[str, ...] = (), separator: str | None = None,
    text_field: str = "text",
) -> Path:  # fmt: skip
    """The token folder of ``data`` (none: the built-in corpus) with a ``vocab_size`` BPE,
    prepared on first use. The built-in corpus has one folder, ``data/stdlib-v<vocab>``; raw
    files go into ``data/cache/``, in a folder named by what it depends on (the inputs'
    paths, sizes and modification times, and the settings), so that the same files give the
    same folder and a changed file another."""
    check_vocab_size(vocab_size, "model.vocab_size")  # in train's words, not prepare's
    if not data:
        folder = default_data_dir(vocab_size)
        if not folder.exists():  # whatever is there is opened, and refused if not a corpus
            note(f"preparing the built-in corpus into {folder} (once)")
            prepare(PrepareConfig(out=str(folder), vocab_size=vocab_size))
        return folder
    if "-" in data:
        raise GpuflowError(
            "train --data cannot cache standard input: prepare it first (gpuflow prepare "
            "--data - --out FOLDER) and train with --set data.dir=FOLDER"
        )
    config = _config(vocab_size, data, separator, text_field)
    folder = _cache_folder(config)
    if is_token_folder(folder):
        note(f"training on {folder}, prepared from the same files before")
        return folder
    note(f"preparing {', '.join(data)} for training into {folder} (once)")
    try:
        prepare(replace(config, out=str(folder)))
    except FolderBusy as busy:  # another run, given the same files, prepares them now
        note(f"process {busy.holder} is preparing the same files into {folder}: waiting for it")
        with OutLock(folder, wait=True):
            pass
        if not is_token_folder(folder):  # it stopped part way: go on from where it was
            prepare(replace(config, out=str(folder)))
    return folder


def cache_folder(
    vocab_size: int, data: tuple[str, ...], separator: str | None = None, text_field: str = "text"
) -> Path:
    """Where ``prepared_for_training`` keeps the tokens of these files and settings, made or
    not (a standard input, ``-``, is never kept)."""
    return _cache_folder(_config(vocab_size, data, separator, text_field))


def _config(
    vocab_size: int, data: tuple[str, ...], separator: str | None, text_field: str
) -> PrepareConfig:
    return PrepareConfig(data=data, vocab_size=vocab_size, separator=separator,
                         text_field=text_field)  # fmt: skip


def _cache_folder(config: PrepareConfig) -> Path:
    return CACHE_DIR / (
        f"{config.out_dir.name.rsplit('-v', 1)[0]}-v{config.vocab_size}-{_key(config)}"
    )


def _key(config: PrepareConfig) -> str:
    """The cache folder's key: the inputs as found now and every setting the tokens depend on."""
    inputs = resolve_inputs(list(config.data))
    settings = {k: v for k, v in asdict(config).items() if k not in ("force", "workers")}
    record = {"inputs": [i.identity() for i in inputs], "piece_chars": PIECE_CHARS, **settings}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
