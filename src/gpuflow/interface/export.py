"""A run's checkpoint as a Hugging Face ``transformers`` GPT-2 folder (``gpuflow export``).

gpuflow's GPT is GPT-2's architecture less its biases: learned positions, pre-LayerNorm
blocks, exact GELU, a head tied to the token table. The folder holds ``config.json``
(``GPT2LMHeadModel``, ``activation_function="gelu"``), ``model.safetensors`` (every bias
written as zeros, the fused q/k/v and the MLP's weights transposed into GPT-2's ``Conv1D``
layout) and the run's tokenizer (``tokenizer.json`` with a ``tokenizer_config.json``).
Writing it needs no ``transformers``; loading it does. Its files are made as a checkpoint's
are: created new, mode 0644 less the umask, fsynced.

What a user of ``transformers`` meets that ``gpuflow sample`` hides is in docs/cli.md
(``gpuflow export``): the context length, and ``<|endoftext|>`` at both ends of the text.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpuflow.common.atomic import fsync_dir, open_new
from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokenizer import EOT, eot_id, load_tokenizer
from gpuflow.interface.sample import open_trained
from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train.runfolder import TOKENIZER_FILE

# GPT-2's Conv1D layers and the nn.Linear of gpuflow's blocks each one is made from
_CONV1D_OF_LINEAR = (
    ("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
    ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj"),
)  # fmt: skip


def gpt2_config(model: ModelConfig, eot: int) -> dict:
    """``config.json`` of the GPT-2 that computes what ``model`` does."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.max_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": 4 * model.d_model,
        "activation_function": "gelu",  # torch's exact GELU, as gpuflow's MLP
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def gpt2_weights(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2's tensors (``transformer.*``; the head is tied) from gpuflow's GPT."""
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    C = model.config.d_model  # GPT-2's biases, which gpuflow lacks, as zeros of their own:
    # safetensors refuses tensors that share memory
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.wpe.weight": state["wpe.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": torch.zeros(C),
    }
    for i in range(model.config.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out[f"{theirs}{norm}.weight"] = state[f"{ours}{norm}.weight"]
            out[f"{theirs}{norm}.bias"] = torch.zeros(C)
        for conv, linear in _CONV1D_OF_LINEAR:  # Conv1D keeps (in, out): Linear's transposed
            weight = state[f"{ours}{linear}.weight"]  # (out, in)
            out[f"{theirs}{conv}.weight"] = weight.t()
            out[f"{theirs}{conv}.bias"] = torch.zeros(weight.shape[0])
    return {k: v.contiguous() for k, v in out.items()}


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
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, stat.S_IMODE(mode_of.stat().st_mode))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GpuflowError(f"{out} is not a folder; pass --out a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise GpuflowError(f"{out} is not empty; pass --out a new or empty folder")


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
    shutil.rmtree(tmp, ignore_errors=True)  # our own, from a killed export of this pid
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
