"""A run's checkpoint as a Hugging Face ``transformers`` GPT-2 folder (``gpuflow export``).

The folder holds ``config.json`` (``GPT2LMHeadModel``), ``model.safetensors`` and the run's
tokenizer (``tokenizer.json`` with a ``tokenizer_config.json``); how gpuflow's GPT maps onto
GPT-2's names and layout is ``gpuflow.model.hf``. Writing it needs no ``transformers``;
loading it does. Its files are made as a checkpoint's are: created new, mode 0644 less the
umask, fsynced.

What a user of ``transformers`` meets that ``gpuflow sample`` hides is in docs/cli.md
(``gpuflow export``): the context length, and ``<|endoftext|>`` at both ends of the text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from gpuflow.common.atomic import fsync_dir, open_new
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.outfolder import check_out_place, pid_is_running
from gpuflow.data.tokenizer_file import EOT, eot_id, load_tokenizer
from gpuflow.interface.sample import open_trained
from gpuflow.model.hf import gpt2_config, gpt2_weights
from gpuflow.train.runfolder import TOKENIZER_FILE


def _write_new(path: Path, data: bytes) -> None:
    """``data`` as the new file ``path``, as a checkpoint's files are made (``open_new``)."""
    with open(open_new(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], mode_of: Path) -> None:
    """The safetensors file of ``tensors``, fsynced. safetensors makes its file 0600 (and
    replaces whatever is there): it is given the mode of ``mode_of``, a file ``_write_new``
    made, so that every file of the export reads the same."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:  # its own error for the system's: said as the system's
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    os.chmod(path, stat.S_IMODE(mode_of.stat().st_mode))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _check_out(out: Path) -> None:
    check_out_place(out)  # the current folder cannot be swapped for the export, as for prepare
    if out.is_symlink():  # the folder is renamed into its place: the link itself would go
        raise GpuflowError(
            f"{out} is a link to {os.readlink(out)}; pass --out a new or empty folder itself"
        )
    if out.exists() and not out.is_dir():
        raise GpuflowError(f"{out} is not a folder; pass --out a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise GpuflowError(f"{out} is not empty; pass --out a new or empty folder")


# What an export writes into its temporary folder.
_EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def _remove_leftovers(out: Path) -> None:
    """Remove the temporary folders of exports to ``out`` that were killed (their process is
    gone), where they hold nothing but what an export writes; anything else stays."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)")
    for entry in out.parent.iterdir() if out.parent.is_dir() else ():
        found = pattern.fullmatch(entry.name)
        if not found or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(found.group(1))
        if pid != os.getpid() and pid_is_running(pid):
            continue  # another export, still at work
        if {p.name for p in entry.iterdir()} <= _EXPORT_FILES:
            shutil.rmtree(entry, ignore_errors=True)


def export_hf(
    run: Path | str, out: Path | str, which: str = "best", say: Callable[[str], None] = print
) -> Path:
    """Write the run's checkpoint ``which`` as a ``transformers`` GPT-2 folder at ``out``
    (new or empty); built beside it and renamed into place, so ``out`` is whole or absent.
    Returns the checkpoint exported."""
    out = Path(out)
    _check_out(out)
    run_dir, config, checkpoint, model = open_trained(run, which, say)
    tokenizer_path = run_dir / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_path)
    eot = eot_id(tokenizer)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    _remove_leftovers(out)
    tmp.mkdir(parents=True)
    try:
        model_config = json.dumps(gpt2_config(config.model, eot), indent=2)
        _write_new(tmp / "config.json", model_config.encode())
        _write_weights(tmp / "model.safetensors", gpt2_weights(model), tmp / "config.json")
        _write_new(tmp / "tokenizer.json", tokenizer_path.read_bytes())
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOT,
            "eos_token": EOT,
            "unk_token": EOT,
            "model_max_length": config.model.max_len,
            # decode as gpuflow's tokenizer does: no spaces taken out before punctuation
            "clean_up_tokenization_spaces": False,
        }
        _write_new(tmp / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2).encode())
        fsync_dir(tmp)
        if out.is_dir():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint
