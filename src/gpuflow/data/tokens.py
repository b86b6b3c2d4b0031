"""A prepared token folder opened for training: its shards, tokenizer and vocabulary bound."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.data.shards import Shard


@dataclass(frozen=True)
class TokenFolder:
    """``train*.bin`` / ``val*.bin`` shards (gpuflow's or llm.c's naming) and tokenizer.json."""

    path: Path
    train: tuple[Shard, ...]
    val: tuple[Shard, ...]
    tokenizer_path: Path | None

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
        )

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
    """Refuse ``source`` (a shard) when its largest token id ``max_id`` has no embedding row."""
    if max_id >= vocab_size:
        raise GpuflowError(
            f"{source} holds token id {max_id} but model.vocab_size is {vocab_size}; set "
            f"model.vocab_size to at least {max_id + 1} (--set model.vocab_size="
            f"{round_up(max_id + 1, 64)}) or prepare the data with --vocab-size {vocab_size}"
        )
