"""Documents cut into bounded pieces where their tokens cannot change, each tagged train or val.

A BPE tokenizer merges only inside pre-tokens, so text cut at a pre-token boundary encodes to
the same tokens as the whole. A stretch of ``PIECE_CHARS`` with no such place is cut at its
end anyway (``Pieces.forced_cuts`` counts them). Each document's first piece decides, by a
hash of its text, whether the document is held out for validation.

Which positions are boundaries and why, other tokenizers, and why a hash:
docs/architecture/data.md (Cutting documents into pieces).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

if TYPE_CHECKING:  # the encoding workers import this module and read no files
    from gpuflow.data.prepare.formats import Part

PIECE_CHARS = 1 << 20  # a piece's most characters: bounds what one encoding holds
# How far back from a piece's end a cut is looked for before it is forced.
SEARCH_CHARS = PIECE_CHARS // 2
CHECK_CHARS = 2048  # each side of a candidate that a tokenizer of another kind encodes
CHECK_TRIES = 16  # candidates checked that way before a cut is forced


@dataclass(frozen=True)
class Piece:
    text: str
    starts_document: bool
    val: bool  # its document is held out for validation
    size: int  # source bytes it accounts for (progress)


def held_out(first_piece: str, val_fraction: float) -> bool:
    """Whether a document whose first piece is ``first_piece`` goes to validation."""
    digest = hashlib.blake2b(first_piece.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") < val_fraction * 2**64


class Cutter:
    """Where a long document may be cut without changing its tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.proven = byte_level_gpt2(tokenizer)

    def cut(self, text: str) -> int | None:
        """The largest safe cut ``0 < i < len(text)`` at most ``SEARCH_CHARS`` from the end:
        ``text[:i]`` and ``text[i:]`` encode to the tokens of ``text``. None: there is none."""
        end, lowest, tries = len(text) - 1, max(1, len(text) - SEARCH_CHARS), 0
        while end >= lowest:
            i = max(text.rfind(" ", lowest, end + 1), text.rfind("\n", lowest, end + 1))
            if i < lowest:
                return None
            if not text[i - 1].isspace():
                if self.proven or self._same_tokens(text, i):
                    return i
                tries += 1
                if tries >= CHECK_TRIES:
                    return None
            end = i - 1
        return None

    def parts(self, text: str, most: int) -> Iterator[str]:
        """``text`` in parts of at most ``most`` characters, cut only where the cut is proven
        harmless (``proven``); from where there is no such place (or with a tokenizer whose
        cuts are not proven), the rest goes on whole."""
        start = 0
        while self.proven and len(text) - start > most:
            cut = self.cut(text[start : start + most + 1])
            if cut is None:
                break
            yield text[start : start + cut]
            start += cut
        yield text[start:] if start else text

    def _same_tokens(self, text: str, i: int) -> bool:
        left, right = text[max(0, i - CHECK_CHARS) : i], text[i : i + CHECK_CHARS]
        encode = self.tokenizer.encode_batch([left + right, left, right], add_special_tokens=False)
        return encode[0].ids == encode[1].ids + encode[2].ids


def byte_level_gpt2(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` pre-tokenizes as GPT-2 does (byte-level, its regex, no prefix
    space, no normalizer): the kind whose safe cuts are proven, not checked."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    # Added tokens are found before pre-tokenizing: one holding whitespace, or taking in the
    # whitespace beside it, could span a cut.
    added = spec.get("added_tokens") or []
    plain_added = all(
        not any(ch.isspace() for ch in t.get("content", "")) and not t.get("lstrip")
        and not t.get("rstrip")
        for t in added
    )  # fmt: skip
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and plain_added
    )


class Pieces:
    """The pieces of a stream of parts: documents up to ``PIECE_CHARS`` whole, longer ones
    cut where their tokens cannot change."""

    def __init__(self, cutter: Cutter, val_fraction: float, piece_chars: int | None = None) -> None:
        self.cutter, self.val_fraction = cutter, val_fraction
        self.piece_chars = piece_chars or PIECE_CHARS
        self.forced_cuts = 0
        self._val = False  # the current document's

    def __call__(self, parts: Iterator[Part]) -> Iterator[Piece]:
        held, size = "", 0  # the current document's text not given out yet, unattributed bytes
        first = True  # the next piece is its document's first
        for part in parts:
            if part.starts_document:
                if held:
                    yield self._piece(held, first, size)
                    size = 0
                held, first = "", True
            held, size = held + part.text, size + part.size
            while len(held) > self.piece_chars:
                head, held = self._cut(held)
                yield self._piece(head, first, size)
                first, size = False, 0
        if held or size:
            yield self._piece(held, first and bool(held), size)

    def _piece(self, text: str, first: bool, size: int) -> Piece:
        if first:
            self._val = held_out(text, self.val_fraction)
        return Piece(text, first, self._val, size)

    def _cut(self, text: str) -> tuple[str, str]:
        window = text[: self.piece_chars + 1]  # a cut at piece_chars keeps the head that long
        at = self.cutter.cut(window)
        if at is None:
            at = self.piece_chars
            self.forced_cuts += 1
        return text[:at], text[at:]
