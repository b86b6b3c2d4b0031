"""A prepared token folder opened for training: its shards, tokenizer and vocabulary bound."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpuflow.data.shards import Shard
from gpuflow.errors import GpuflowError


@dataclass(frozen=True)
class TokenFolder:
    """``train*.bin`` / ``val*.bin`` shards (gpuflow's or llm.c's naming) and tokenizer.json."""

    path: Path
    train: tuple[Shard, ...]
    val: tuple[Shard, ...]
    tokenizer_path: Path | None
    max_token: int

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
        tokenizer_path = path / "tokenizer.json"
        return cls(
            path=path,
            train=train,
            val=val,
            tokenizer_path=tokenizer_path if tokenizer_path.is_file() else None,
            max_token=_max_token(path, train, val),
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse data whose token ids the model's embedding table cannot index."""
        if self.max_token >= vocab_size:
            raise GpuflowError(
                f"{self.path} holds token id {self.max_token} but model.vocab_size is "
                f"{vocab_size}; set model.vocab_size to at least {self.max_token + 1} "
                f"(--set model.vocab_size={_round_up(self.max_token + 1, 64)}) or prepare the data "
                f"with --vocab-size {vocab_size}"
            )

    @property
    def train_tokens(self) -> int:
        return sum(s.n_tokens for s in self.train)

    @property
    def val_tokens(self) -> int:
        return sum(s.n_tokens for s in self.val)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _max_token(path: Path, train: tuple[Shard, ...], val: tuple[Shard, ...]) -> int:
    """The largest token id: from meta.json when it still describes these shards, else read."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if (meta["train_tokens"], meta["val_tokens"]) == (
            sum(s.n_tokens for s in train),
            sum(s.n_tokens for s in val),
        ):
            return int(meta["max_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no meta.json (llm.c data) or a damaged one: read the tokens instead
    return max(shard.max_token() for shard in train + val)
