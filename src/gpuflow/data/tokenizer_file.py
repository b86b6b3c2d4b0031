"""A tokenizer as token folders hold it: a Hugging Face ``tokenizer.json`` loaded from a file,
a folder holding one (a token folder, a ``transformers`` model folder) or a name on the hub,
and the end-of-text token that starts every document (shards are plain token streams, as
llm.c and modded-nanogpt write them, so the model learns where documents start). Training a
tokenizer is preparation's: ``gpuflow.data.prepare.tokenizer``.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from tokenizers import Tokenizer

from gpuflow.common.errors import GpuflowError, first_line

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols and the end-of-text token


def load_tokenizer(spec: Path | str) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json``, a folder holding one (a token folder, a
    ``transformers`` model folder), or a name on the Hugging Face hub (``gpt2``), fetched."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise GpuflowError(f"folder {path} holds no tokenizer.json; pass the file itself")
        path = path / "tokenizer.json"
    elif not path.exists() and _looks_like_hub_name(str(spec)):
        return _checked(_from_hub(str(spec)), str(spec))
    if not path.is_file():
        raise GpuflowError(f"tokenizer file {path} does not exist; pass a tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception on malformed files
        raise GpuflowError(
            f"{path} is not a Hugging Face tokenizer.json ({first_line(exc)})"
        ) from None
    return _checked(tokenizer, str(path))


def _checked(tokenizer: Tokenizer, source: str) -> Tokenizer:
    if tokenizer.token_to_id(EOT) is None:
        raise GpuflowError(
            f"tokenizer {source} has no {EOT} token, which separates documents; "
            "add it as a special token or let `gpuflow prepare` train one"
        )
    return tokenizer


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
HUB_HOST = "huggingface.co"


def _looks_like_hub_name(spec: str) -> bool:
    return bool(_HUB_NAME.fullmatch(spec)) and not spec.endswith(".json")


def _from_hub(name: str) -> Tokenizer:
    """``name``'s tokenizer.json from the hub; offline, one line at once (the library's own
    client would retry for most of a minute first)."""
    try:
        socket.create_connection((HUB_HOST, 443), timeout=5).close()
    except OSError as exc:
        raise GpuflowError(
            f"{name} is no file here and the Hugging Face hub ({HUB_HOST}) cannot be reached "
            f"({exc.strerror or exc}); fetch its tokenizer.json where there is a network and "
            "pass the file"
        ) from None
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as exc:  # tokenizers raises plain Exception for HTTP errors
        raise GpuflowError(
            f"could not fetch tokenizer {name} from the Hugging Face hub ({first_line(exc)}); "
            "check the name, or pass a tokenizer.json"
        ) from None


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    assert token_id is not None, "load_tokenizer and train_tokenizer guarantee an EOT token"
    return token_id


def vocab_bound(tokenizer: Tokenizer) -> int:
    """The vocabulary a tokenizer's ids need: its largest id + 1 (added tokens included). Its
    count of entries is less where its ids have gaps (a WordLevel file may number its words
    as it likes), and shards and a model sized by that count could not hold every id."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(largest + 1, tokenizer.get_vocab_size())
