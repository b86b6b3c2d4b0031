"""Byte-level BPE tokenizers through Hugging Face ``tokenizers``.

Every document is preceded by the end-of-text token, as llm.c and modded-nanogpt do, so
shards are plain token streams and the model learns where documents start.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpuflow.common.errors import GpuflowError

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols and the end-of-text token


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens; ``EOT`` gets id 0.

    A small corpus may stop short of ``vocab_size`` when it runs out of pairs to merge.
    """
    if vocab_size < MIN_VOCAB:
        raise GpuflowError(
            f"vocab size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: Path | str) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise GpuflowError(f"tokenizer file {path} does not exist; pass a tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception on malformed files
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GpuflowError(f"{path} is not a Hugging Face tokenizer.json ({first_line})") from None
    if tokenizer.token_to_id(EOT) is None:
        raise GpuflowError(
            f"tokenizer {path} has no {EOT} token, which separates documents; "
            "add it as a special token or let `gpuflow prepare` train one"
        )
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    assert token_id is not None, "load_tokenizer and train_tokenizer guarantee an EOT token"
    return token_id
