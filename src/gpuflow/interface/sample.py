"""Text generation from a run's best checkpoint (lowest validation loss), or another one.

    gpuflow sample --run runs/tiny --prompt "The list type" --max-tokens 100
    gpuflow sample --run runs/tiny --checkpoint latest

Tokens are drawn on the device and read back once, at the end, not once per token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokenizer_file import eot_id, load_tokenizer
from gpuflow.device.accelerator import Device
from gpuflow.model.generate import generate_no_sync
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig
from gpuflow.train.runfolder import TOKENIZER_FILE, open_run
from gpuflow.transfer.loader import upload_tokens
from gpuflow.transfer.mirror import read_now
from gpuflow.transfer.upload import place


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = ""
    max_tokens: int = 200
    temperature: float = 0.8  # 0 picks the most likely token every time
    top_k: int = 50  # 0 samples from the whole vocabulary
    seed: int = 0
    checkpoint: str = "best"  # best, latest, or a checkpoint's folder name (step_000300)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise GpuflowError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails it too
            raise GpuflowError(f"--temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GpuflowError(f"--top-k must be >= 0, got {self.top_k}")
        check_text(self.prompt, "--prompt")


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid UTF-8: bytes a shell passed that Python could only
    carry as lone surrogates, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start].encode("utf-8", "surrogateescape")
        raise GpuflowError(
            f"{what} is not valid UTF-8 text (byte 0x{bad.hex()} at character {exc.start}); "
            "pass UTF-8 text (set your terminal or file to UTF-8)"
        ) from None


def choose_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint ``which`` names: ``best`` (the latest when the run has no best yet),
    ``latest``, or one of the run's own checkpoint folders, by name (``step_000300``) or by
    its path in the run; anything else, a link included, is refused."""
    latest, best = ckpt.latest_checkpoint(run_dir), ckpt.best_checkpoint(run_dir)
    if latest is None and best is None:
        raise GpuflowError(f"{run_dir} has no checkpoint yet; train it first")
    if which == "best":
        return best or latest
    if which == "latest":
        return latest or best
    path = ckpt.checkpoint_dir(run_dir) / _checkpoint_name(run_dir, which)
    if not ckpt.written_here(path):
        names = ", ".join(p.name for p in ckpt.list_checkpoints(run_dir))
        raise GpuflowError(
            f"{run_dir} has no checkpoint {which!r}; choose best, latest or one of {names}"
        )
    return path


def _checkpoint_name(run_dir: Path, which: str) -> str:
    """The folder name in ``run_dir``'s checkpoints/ that ``which`` gives: a bare name, or a
    path whose folder is that one (the final name is not followed: a link there is refused
    after)."""
    given = Path(which)
    folder = ckpt.checkpoint_dir(run_dir)
    inside = len(given.parts) == 1 or os.path.realpath(given.parent) == os.path.realpath(folder)
    if not inside or given.name in ("", ".", ".."):
        raise GpuflowError(
            f"--checkpoint {which} is not one of {run_dir}'s checkpoints: gpuflow reads only "
            f"the run's own; pass best, latest or a folder name in {folder} (step_000300)"
        )
    return given.name


def check_finite(model: GPT, checkpoint: Path, record: dict) -> None:
    """Refuse weights that are no longer numbers: they would sample noise without a word."""
    bad = [name for name, p in model.state_dict().items() if not torch.isfinite(p).all()]
    if bad:
        raise GpuflowError(
            f"checkpoint {checkpoint} (step {record['step']}) holds NaN or infinite weights "
            f"({bad[0]}{' and more' if len(bad) > 1 else ''}): the run diverged; sample an "
            "earlier checkpoint with --checkpoint step_NNNNNN"
        )


def open_trained(
    run: Path | str, which: str, say: Callable[[str], None]
) -> tuple[Path, RunConfig, Path, GPT]:
    """A run's folder, config, checkpoint ``which`` (``say`` hears it when it is not the one
    asked for) and model with its weights, on the host; refused when the run has no
    tokenizer (its tokens could not be turned into text) or its weights are not numbers."""
    run_dir, run_config = open_run(run)
    ckpt.check_checkpoint_folder(run_dir)  # links planted there: refused, as --resume does
    checkpoint = choose_checkpoint(run_dir, which)
    if which == "best" and checkpoint.name != ckpt.BEST:
        say(f"{run_dir} has no best checkpoint yet (no validation pass): using {checkpoint.name}")
    elif which == "latest" and checkpoint.name == ckpt.BEST:
        say(f"{run_dir} has no step checkpoint: using its best one")
    tokenizer_path = run_dir / TOKENIZER_FILE
    if tokenizer_path.is_symlink():
        raise GpuflowError(
            f"{tokenizer_path} is a link; gpuflow reads only a run's own files, never through "
            "a link: put the tokenizer.json itself there"
        )
    if not tokenizer_path.is_file():
        raise GpuflowError(
            f"{run_dir} has no {TOKENIZER_FILE} (its data came without one), so its tokens "
            f"cannot be turned into text; copy the data's tokenizer.json to {tokenizer_path}"
        )
    model = GPT(run_config.model)
    try:
        record = ckpt.load_weights(checkpoint, model)
    except ckpt.CheckpointDamaged as exc:
        raise GpuflowError(f"{exc}; {_another(run_dir, checkpoint)}") from None
    check_finite(model, checkpoint, record)
    return run_dir, run_config, checkpoint, model


def _another(run_dir: Path, damaged: Path) -> str:
    """What to do when ``damaged`` cannot be read: which checkpoints are left to choose."""
    others = [ckpt.best_checkpoint(run_dir), *ckpt.list_checkpoints(run_dir)]
    names = [p.name for p in others if p is not None and p != damaged]
    if not names:
        return "the run has no other checkpoint: train it again"
    return f"choose another with --checkpoint ({', '.join(names)})"


def sample(
    run: Path | str, config: SampleConfig, device: Device, say: Callable[[str], None] = print
) -> str:
    """Generated text (the prompt first), cut at the first end-of-text token. ``say`` hears
    which checkpoint was used when it is not the one asked for."""
    run_dir, run_config, _, model = open_trained(run, config.checkpoint, say)
    tokenizer = load_tokenizer(run_dir / TOKENIZER_FILE)
    place(model, device.torch).eval()

    eot = eot_id(tokenizer)
    prompt_ids = [eot, *tokenizer.encode(config.prompt, add_special_tokens=False).ids]
    if max(prompt_ids) >= run_config.model.vocab_size:
        raise GpuflowError("the prompt encodes to ids outside the model's vocabulary")
    torch.manual_seed(config.seed)
    idx = upload_tokens(np.asarray([prompt_ids], dtype=np.int64), device)  # (1, t)
    with device.autocast():
        out = generate_no_sync(model, idx, config.max_tokens, config.temperature, config.top_k)
    ids = read_now(out[0])
    generated = ids[len(prompt_ids) :]
    if eot in generated:
        generated = generated[: generated.index(eot)]
    return tokenizer.decode(prompt_ids[1:] + generated)
