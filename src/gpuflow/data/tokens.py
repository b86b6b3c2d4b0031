"""A prepared token folder opened for training: its shards, tokenizer and vocabulary bound.

Opening a folder parses its tokenizer.json and checks its vocabulary against meta.json's;
the shards' ids are checked against the tokenizer's vocabulary, as against the model's,
where they are read (``check_ids``), so that shards made with another tokenizer are refused
before they train a model whose samples would be garbage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.data.shards import Shard
from gpuflow.data.tokenizer import load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
# The tokenizer of each token folder opened, by folder: (its file, its vocabulary). The
# readers call ``check_ids`` with a shard's path and largest id alone; this is how it knows
# the vocabulary of the tokenizer beside that shard.
_TOKENIZERS: dict[Path, tuple[Path, int]] = {}


@dataclass(frozen=True)
class TokenFolder:
    """``train*.bin`` / ``val*.bin`` shards (gpuflow's or llm.c's naming) and tokenizer.json."""

    path: Path
    train: tuple[Shard, ...]
    val: tuple[Shard, ...]
    tokenizer_path: Path | None
    vocab: int | None = None  # the tokenizer's vocabulary (None: the folder has no tokenizer)

    @classmethod
    def open(cls, path: Path | str) -> TokenFolder:
        path = Path(path)
        if not path.is_dir():
            raise GpuflowError(
                f"token folder {path} does not exist; run `gpuflow prepare --out {path}` first"
            )
        # gpuflow writes train_000000.bin; llm.c and modded-nanogpt write *_train_000001.bin.
        train = tuple(Shard.open(p) for p in sorted(path.glob("*train*.bin")))
        val = tuple(Shard.open(p) for p in sorted(path.glob("*val*.bin")))
        if not train or not val:
            missing = "train" if not train else "val"
            raise GpuflowError(
                f"token folder {path} has no {missing} shards (*{missing}*.bin); "
                "prepare it with `gpuflow prepare`"
            )
        tokenizer_path = path / TOKENIZER_FILE
        if not tokenizer_path.is_file():  # llm.c's folders have none: their ids go unchecked
            _TOKENIZERS.pop(path.resolve(), None)
            return cls(path=path, train=train, val=val, tokenizer_path=None)
        vocab = tokenizer_vocab(tokenizer_path)
        check_meta_vocab(path / META_FILE, tokenizer_path, vocab)
        _TOKENIZERS[path.resolve()] = (tokenizer_path, vocab)
        return cls(path=path, train=train, val=val, tokenizer_path=tokenizer_path, vocab=vocab)

    def check_vocab(self, vocab_size: int, splits: tuple[str, ...] = ("train", "val")) -> None:
        """Refuse data whose token ids the model's embedding table cannot index, reading every
        shard of ``splits``: meta.json's record is not trusted, since a shard may have been
        replaced after it was written. (A resident corpus checks its train shards as they
        upload instead: ``ResidentTokens``.)"""
        for shard in (s for split in splits for s in getattr(self, split)):
            check_ids(shard.path, shard.max_token(), vocab_size)

    @cached_property
    def max_token(self) -> int:
        """The largest token id in any shard (reads them all)."""
        return max(shard.max_token() for shard in self.train + self.val)

    @property
    def train_tokens(self) -> int:
        return sum(s.n_tokens for s in self.train)

    @property
    def val_tokens(self) -> int:
        return sum(s.n_tokens for s in self.val)


def check_ids(source: Path | str, max_id: int, vocab_size: int) -> None:
    """Refuse ``source`` (a shard) when its largest token id ``max_id`` has no embedding row,
    or no token in the tokenizer of the folder it was opened from (``TokenFolder.open``)."""
    if max_id >= vocab_size:
        raise GpuflowError(
            f"{source} holds token id {max_id} but model.vocab_size is {vocab_size}; set "
            f"model.vocab_size to at least {max_id + 1} (--set model.vocab_size="
            f"{round_up(max_id + 1, 64)}) or prepare the data with --vocab-size {vocab_size}"
        )
    tokenizer = _TOKENIZERS.get(Path(source).resolve().parent)
    if tokenizer is not None and max_id >= tokenizer[1]:
        raise GpuflowError(
            f"{source} holds token id {max_id} but {tokenizer[0]} has {tokenizer[1]:,} tokens: "
            "the shards were not made with that tokenizer; prepare the folder again, or put "
            "back the tokenizer.json they were made with"
        )


def tokenizer_vocab(path: Path) -> int:
    """The vocabulary of the tokenizer.json at ``path``, refused in one line where it is not
    one (it would be copied into the run, and found out only when sampling)."""
    try:
        tokenizer = load_tokenizer(path)
    except GpuflowError as exc:
        raise GpuflowError(
            f"{exc}; the token folder needs the tokenizer its shards were made with: prepare "
            "it again, or put that tokenizer.json back"
        ) from None
    return tokenizer.get_vocab_size()


def check_meta_vocab(meta: Path, tokenizer_path: Path, vocab: int) -> None:
    """Refuse a folder whose meta.json (written by ``prepare`` with the tokenizer) records
    another vocabulary than its tokenizer's; a folder without one is not checked."""
    if not meta.is_file():
        return
    try:
        recorded = json.loads(meta.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise GpuflowError(
            f"{meta} is not JSON ({exc}); prepare the token folder again, or remove it if the "
            "folder was not made by gpuflow"
        ) from None
    said = recorded.get("vocab_size") if isinstance(recorded, dict) else None
    if isinstance(said, int) and said != vocab:
        raise GpuflowError(
            f"{meta} records a vocabulary of {said:,} tokens but {tokenizer_path} has "
            f"{vocab:,}: the tokenizer is not the one the shards were made with; prepare the "
            "folder again, or put back its own tokenizer.json"
        )
