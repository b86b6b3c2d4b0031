"""A prepared token folder opened for training: its shards, tokenizer and vocabulary bound.

Opening a folder parses its tokenizer.json and checks its vocabulary against meta.json's;
the shards' ids are checked against the tokenizer's vocabulary, as against the model's,
where they are read (``check_ids``), so that shards made with another tokenizer are refused
before they train a model whose samples would be garbage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.data.shards import Shard
from gpuflow.data.tokenizer_file import MIN_VOCAB, load_tokenizer, vocab_bound

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
# gpuflow writes train_000000.bin; llm.c and modded-nanogpt write *_train_000001.bin. The
# split is a word of the name, not any run of its letters: retrieval_train_000000.bin is a
# train shard, not also a val one.
_SPLIT_WORDS = {
    "train": re.compile(r"(?<![A-Za-z])train(?:ing)?(?![A-Za-z])"),
    "val": re.compile(r"(?<![A-Za-z])val(?:id|idation)?(?![A-Za-z])"),
}
# The tokenizer of each token folder opened, by folder: (its file, its vocabulary). The
# readers call ``check_ids`` with a shard's path and largest id alone; this is how it knows
# the vocabulary of the tokenizer beside that shard.
_TOKENIZERS: dict[Path, tuple[Path, int]] = {}


@dataclass(frozen=True)
class TokenFolder:
    """Train and val shards (gpuflow's or llm.c's naming: ``shard_files``) and tokenizer.json."""

    path: Path
    train: tuple[Shard, ...]
    val: tuple[Shard, ...]
    tokenizer_path: Path | None
    vocab: int | None = None  # the tokenizer's vocabulary (None: the folder has no tokenizer)

    @classmethod
    def open(cls, path: Path | str, vocab_size: int | None = None) -> TokenFolder:
        """The folder at ``path``; ``vocab_size``, the model's, goes into the command a
        missing folder's refusal names, so that the folder it prepares fits the model."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise GpuflowError(
                f"token folder {path} is a file, not a folder; data.dir names a folder that "
                "gpuflow prepare wrote (to train on files as they are: gpuflow train --data "
                f"{path})"
            )
        if not path.is_dir():
            vocab = f" --vocab-size {vocab_size}" if (vocab_size or 0) >= MIN_VOCAB else ""
            raise GpuflowError(
                f"token folder {path} does not exist; run `gpuflow prepare --out {path}{vocab}` "
                "first (with --data PATH... for your own corpus; without it, the built-in one)"
            )
        named = shard_files(path)
        train = tuple(Shard.open(p) for p in named["train"])
        val = tuple(Shard.open(p) for p in named["val"])
        if not train or not val:
            missing = "train" if not train else "val"
            raise GpuflowError(
                f"token folder {path} has no {missing} shards (.bin files with '{missing}' "
                "as a word of their name); prepare it with `gpuflow prepare`"
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
    or no token in the tokenizer of the folder it was opened from (``TokenFolder.open``).

    The shards are checked one at a time, but a refusal speaks for the whole folder (read
    then, on the way out): what it says to set holds every shard's ids, so that following it
    does not meet a larger id in the next shard."""
    source = Path(source)
    tokenizer = _TOKENIZERS.get(source.resolve().parent)
    if max_id < vocab_size and (tokenizer is None or max_id < tokenizer[1]):
        return
    shard, largest = _largest_id(source, max_id)
    if tokenizer is not None and largest >= tokenizer[1]:  # no vocabulary setting mends that
        model = f"model.vocab_size is {vocab_size} and " if largest >= vocab_size else ""
        raise GpuflowError(
            f"{shard} holds token id {largest} but {model}{tokenizer[0]} has "
            f"{tokenizer[1]:,} tokens: the shards were not made with that tokenizer; prepare "
            "the folder again, or put back the tokenizer.json they were made with"
        )
    # The vocabulary named holds the folder's largest id and, where the folder has a
    # tokenizer, each of its tokens (a prompt may encode to any), rounded up to 64.
    needed = max(largest + 1, tokenizer[1] if tokenizer is not None else 0)
    why = [f"{shard.name} holds id {largest}"] if largest > max_id else []
    if tokenizer is not None and needed > largest + 1:
        why.append(f"{tokenizer[0].name} has {tokenizer[1]:,} tokens")
    advice = f"train with --set model.vocab_size={round_up(needed, 64)}"
    advice += f" ({' and '.join(why)})" if why else ""
    if vocab_size >= MIN_VOCAB:  # a vocabulary prepare can train
        advice += f", or prepare the data again with --vocab-size {vocab_size}"
    raise GpuflowError(
        f"{source} holds token id {max_id} but model.vocab_size is {vocab_size}; {advice}"
    )


def _largest_id(source: Path, max_id: int) -> tuple[Path, int]:
    """The shard of ``source``'s folder holding the largest id, and that id (``source``'s own,
    ``max_id``, unless another train or val shard holds a larger one; a shard that cannot be
    read is passed over: it is refused where it is read)."""
    found = (source, max_id)
    named = shard_files(source.parent)
    for path in sorted({*named["train"], *named["val"]}):
        try:
            largest = Shard.open(path).max_token()
        except (GpuflowError, OSError, ValueError):
            continue
        if largest > found[1]:
            found = (path, largest)
    return found


def shard_files(folder: Path) -> dict[str, list[Path]]:
    """The folder's ``.bin`` files by split, in name order; one whose name holds both splits'
    words (``train_val.bin``) is refused rather than read as either."""
    named: dict[str, list[Path]] = {"train": [], "val": []}
    for path in sorted(folder.glob("*.bin")):
        splits = [split for split, word in _SPLIT_WORDS.items() if word.search(path.stem)]
        if len(splits) > 1:
            raise GpuflowError(
                f"{path} names both a train and a val split; rename it so that its name "
                "holds one of them"
            )
        for split in splits:
            named[split].append(path)
    return named


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
    return vocab_bound(tokenizer)


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
    if not isinstance(said, int) or isinstance(said, bool):  # an edit, or not prepare's
        raise GpuflowError(
            f"{meta} records no vocabulary (vocab_size is {said!r}); prepare the token folder "
            "again, or remove meta.json if the folder was not made by gpuflow"
        )
    if said != vocab:
        raise GpuflowError(
            f"{meta} records a vocabulary of {said:,} tokens but {tokenizer_path} has "
            f"{vocab:,}: the tokenizer is not the one the shards were made with; prepare the "
            "folder again, or put back its own tokenizer.json"
        )
