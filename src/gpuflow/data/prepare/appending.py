"""``prepare --append``: more documents added to a token folder, all or nothing.

The folder is checked whole before any work: its files (only prepare's own), its meta.json
(every field appending reads, of its type), its shards (those meta.json counts, numbered
from 0) and its tokenizer (of the vocabulary meta.json states). The new shards are encoded
into the staging folder as a new folder's are; ``commit`` then hard-links the old folder's
files beside them, writes the new meta.json there and swaps the staging folder in by the two
renames of ``--force``. A kill or an error at any moment leaves the old folder or the new
one, whole, and an input is never added twice: meta.json lists it exactly when its shards
are there.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tokenizers import Tokenizer

from gpuflow.common.atomic import fsync_dir, write_text_atomic
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.inputs import Input
from gpuflow.data.prepare.outfolder import foreign_entries, is_token_folder, listed, swap_into_place
from gpuflow.data.shards import Shard, token_dtype_for
from gpuflow.data.tokenizer_file import load_tokenizer, vocab_bound

SPLITS = ("train", "val")
# The fields of meta.json that appending reads or updates, and what each must hold.
_COUNTS = ("documents", "train_tokens", "val_tokens", "train_shards", "val_shards", "vocab_size")
_SHARD = re.compile(r"(train|val)_(\d{6,})\.bin")
# Where a file system refuses hard links, the old folder's files are copied instead.
_NO_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass(frozen=True)
class AppendTarget:
    """A token folder that ``--append`` may add to, as it was when checked."""

    path: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    files: tuple[tuple[str, int, int, int], ...]  # (name, size, mtime_ns, inode), sorted

    def next_index(self, split: str) -> int:
        return self.meta[f"{split}_shards"]


def check_target(out_dir: Path, tokenizer_given: str) -> AppendTarget:
    """The token folder ``out_dir``, checked whole (see the module docstring) before any work
    is done for it; every fault is one line naming it."""
    if tokenizer_given:
        raise GpuflowError(
            "--append encodes with the folder's own tokenizer: leave --tokenizer out"
        )
    if out_dir.is_symlink():
        raise GpuflowError(
            f"{out_dir} is a link; --append writes only into the folder itself: pass the "
            "folder it points to as --out"
        )
    if not is_token_folder(out_dir):
        raise GpuflowError(
            f"{out_dir} is not a token folder that gpuflow prepare wrote; --append adds to one"
        )
    foreign = foreign_entries(out_dir)
    if foreign:
        raise GpuflowError(
            f"{out_dir} holds files gpuflow did not write ({listed(foreign)}); --append adds "
            "only to a folder of prepare's own files: move them out, then run it again"
        )
    files = _snapshot(out_dir)  # before anything is read: a change after is found at commit
    meta = _read_meta(out_dir)
    _check_meta(out_dir, meta)
    try:
        tokenizer = load_tokenizer(out_dir / "tokenizer.json")
    except GpuflowError as exc:
        _damaged(out_dir, str(exc))
    vocab = vocab_bound(tokenizer)  # what prepare recorded: not its entries, where ids have gaps
    if vocab != meta["vocab_size"] or token_dtype_for(vocab).name != meta["token_dtype"]:
        _damaged(
            out_dir,
            f"its tokenizer.json has {vocab:,} tokens but meta.json states vocab_size "
            f"{meta['vocab_size']:,} and {meta['token_dtype']} shards",
        )
    _check_shards(out_dir, meta)
    return AppendTarget(out_dir, meta, tokenizer, files)


def _damaged(out_dir: Path, what: str) -> NoReturn:
    raise GpuflowError(
        f"{out_dir} cannot be appended to: {what}; it was changed outside gpuflow: put back "
        "what prepare wrote, or rebuild the folder with gpuflow prepare --force"
    )


def _read_meta(out_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        _damaged(out_dir, f"its meta.json cannot be read ({exc})")
    if not isinstance(meta, dict):
        _damaged(out_dir, "its meta.json holds no object")
    return meta


def _field(key: str, value: object) -> str:
    shown = repr(value)
    return f"meta.json's {key} is {shown[:40] + '...' if len(shown) > 40 else shown}"


def _check_meta(out_dir: Path, meta: dict[str, Any]) -> None:
    """Every field that appending reads or updates holds what prepare writes there."""
    for key in (*_COUNTS, "max_token"):
        value, least = meta.get(key), -1 if key == "max_token" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            _damaged(out_dir, f"{_field(key, value)}, not a count")
    for key in ("source", "token_dtype"):
        if not isinstance(meta.get(key), str):
            _damaged(out_dir, f"{_field(key, meta.get(key))}, not text")
    if meta["token_dtype"] not in ("uint16", "uint32"):
        _damaged(out_dir, f"{_field('token_dtype', meta['token_dtype'])}, not uint16 or uint32")
    inputs = meta.get("inputs")
    if not isinstance(inputs, list) or not all(i is None or isinstance(i, dict) for i in inputs):
        _damaged(out_dir, f"{_field('inputs', inputs)}, not a list of inputs")


def _check_shards(out_dir: Path, meta: dict[str, Any]) -> None:
    """The shards are those meta.json counts, numbered from 0, of its token type and counts
    (their headers and sizes are read, not their tokens)."""
    found: dict[str, list[Shard]] = {split: [] for split in SPLITS}
    for path in sorted(out_dir.glob("*.bin")):
        match = _SHARD.fullmatch(path.name)
        if match:
            try:
                found[match[1]].append(Shard.open(path))
            except GpuflowError as exc:
                _damaged(out_dir, str(exc).split(";")[0])
    for split, shards in found.items():
        indices = [int(_SHARD.fullmatch(s.path.name)[2]) for s in shards]
        tokens = sum(s.n_tokens for s in shards)
        counted = (meta[f"{split}_shards"], meta[f"{split}_tokens"])
        if indices != list(range(len(shards))) or (len(shards), tokens) != counted:
            _damaged(
                out_dir,
                f"meta.json counts {counted[0]} {split} shards of {counted[1]:,} tokens but the "
                f"folder holds {len(shards)} (numbered {_ranges(indices)}) of {tokens:,}",
            )
        for shard in shards:
            if shard.dtype.name != meta["token_dtype"]:
                _damaged(out_dir, f"{shard.path.name} holds {shard.dtype.name} tokens, "
                                  f"not the {meta['token_dtype']} of meta.json")  # fmt: skip


def _ranges(indices: list[int]) -> str:
    return f"{indices[0]} to {indices[-1]}" if indices else "none"


def refuse_repeats(
    inputs: Sequence[Input], identities: Sequence[Any], target: AppendTarget
) -> None:
    """An input the folder already holds is refused: the same file unchanged, or changed
    since (a file that grew: its old text would be in the folder twice)."""
    by_path = {i["path"]: i for i in target.meta["inputs"] if isinstance(i, dict) and "path" in i}
    for inp, identity in zip(inputs, identities, strict=True):
        then = None if identity is None else by_path.get(identity["path"])  # (None: stdin)
        if then is None:
            continue
        if then == identity:
            raise GpuflowError(
                f"{inp.name} is already in {target.path} (the same file, unchanged); leave it out"
            )
        raise GpuflowError(
            f"{inp.name} is already in {target.path} as it was then ({then['size']:,} bytes; "
            f"{identity['size']:,} now): appending it again would add its old text twice; "
            "put only its new text in a file of its own, or prepare a new folder"
        )


def _snapshot(folder: Path) -> tuple[tuple[str, int, int, int], ...]:
    entries = []
    for path in sorted(folder.iterdir()):
        st = path.stat(follow_symlinks=False)
        entries.append((path.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(entries)


def _check_unchanged(target: AppendTarget) -> None:
    if _snapshot(target.path) != target.files:
        raise GpuflowError(
            f"{target.path} was changed by something else while --append ran; it is left as "
            "that left it: check it, then run the command again"
        )


def commit(stage: Path, target: AppendTarget, added: dict[str, Any]) -> None:
    """Make ``stage`` (the new shards, nothing else) the whole new folder, then swap it in.

    ``added``: the new shards' documents, tokens, shards (by split), largest id, inputs and
    how they were read.
    """
    _check_unchanged(target)
    for name, *_ in target.files:
        if name != "meta.json":
            _link_or_copy(target.path / name, stage / name)
    meta = dict(target.meta)
    for key in ("documents", *(f"{s}_{what}" for s in SPLITS for what in ("tokens", "shards"))):
        meta[key] = target.meta[key] + added[key]
    meta.update(
        max_token=max(target.meta["max_token"], added["max_token"]),
        inputs=[*target.meta["inputs"], *added["inputs"]],
        source=f"{target.meta['source']}; {added['source']}".strip("; "),
        appends=[
            *target.meta.get("appends", []),
            {"source": added["source"], "inputs": len(added["inputs"]), **added["read_with"]},
        ],
    )
    write_text_atomic(stage / "meta.json", json.dumps(meta, indent=2) + "\n")
    fsync_dir(stage)
    _check_unchanged(target)  # again: just before the swap
    swap_into_place(stage, target.path)


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` as another name of ``source`` (a copy where the file system has no links);
    nothing is ever written through the link."""
    target.unlink(missing_ok=True)  # (the staging folder is this process's own)
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        shutil.copyfile(source, target, follow_symlinks=False)
