"""How many bytes of UTF-8 text each token id stands for: the denominator of bits per byte.

Validation loss is in nats per token, so it depends on the tokenizer: a tokenizer with longer
tokens has fewer, harder targets. Bits per byte divides the loss summed over the targets by
the bytes those targets stand for, which is the same text whatever cuts it into tokens.

A byte-level BPE (GPT-2's layout, and what ``gpuflow prepare`` trains) writes each byte as one
printable character; a vocabulary string is read back into bytes through that alphabet, as
the tokenizer's own ``ByteLevel`` decoder does. Special tokens (``<|endoftext|>``) stand for
no text and count 0 bytes; other added tokens are matched on the raw text, so they count the
UTF-8 bytes of their content.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders

from gpuflow.data.tokenizer_file import load_tokenizer, vocab_bound


@cache
def byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for (256 characters).

    Bytes that print as themselves in Latin-1 (``!`` to ``~``, ``¡`` to ``¬``, ``®`` to
    ``ÿ``) keep their own character; the others (controls, space, no-break space, soft
    hyphen) take the characters from U+0100 on, in byte order, so that no token holds a
    space or an invisible character."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    moved = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(0x100 + moved)] = byte
            moved += 1
    return alphabet


def is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` decodes its vocabulary strings through the byte-level alphabet
    (others, such as SentencePiece's, spell text another way: their lengths are not
    counted here)."""
    return isinstance(tokenizer.decoder, decoders.ByteLevel)


def vocabulary_bytes(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """The UTF-8 byte length of each id below ``vocab_size`` (int64, shape (vocab_size,)):
    0 for special tokens and for ids past the tokenizer's vocabulary (a model's table is
    rounded up beyond it). ``tokenizer`` must be byte-level (``is_byte_level``)."""
    alphabet = byte_level_alphabet()
    lengths = np.zeros(vocab_size, dtype=np.int64)
    added = tokenizer.get_added_tokens_decoder()
    for token_id in range(min(vocab_size, vocab_bound(tokenizer))):
        if token_id in added:
            token = added[token_id]
            lengths[token_id] = 0 if token.special else len(token.content.encode("utf-8"))
            continue
        text = tokenizer.id_to_token(token_id)
        if text is None:  # a hole in the ids: no token, no text
            continue
        # As the ByteLevel decoder reads it: a string with a character outside the alphabet
        # is taken as the text it spells.
        if all(char in alphabet for char in text):
            lengths[token_id] = len(text)
        else:
            lengths[token_id] = len(text.encode("utf-8"))
    return lengths


def token_bytes(tokenizer_path: Path | str, vocab_size: int) -> np.ndarray | None:
    """The UTF-8 byte length of each id below ``vocab_size`` for the tokenizer.json at
    ``tokenizer_path`` (``vocabulary_bytes``); None where it is not byte-level, whose
    lengths this cannot read."""
    tokenizer = load_tokenizer(Path(tokenizer_path))
    if not is_byte_level(tokenizer):
        return None
    return vocabulary_bytes(tokenizer, vocab_size)


def target_bytes(windows: list[np.ndarray], lengths: np.ndarray) -> int:
    """The UTF-8 bytes of the targets of ``windows`` (each (B, T+1): the last T ids of each
    row are its targets), by the byte length of each id, ``lengths``."""
    return sum(int(lengths[w[:, 1:]].sum()) for w in windows)
