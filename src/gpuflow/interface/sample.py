"""Text generation from a run's best checkpoint (lowest validation loss), or another one.

    gpuflow sample --run runs/tiny --prompt "The list type" --max-tokens 100
    gpuflow sample --run runs/tiny --checkpoint latest

Tokens are drawn on the device and read back once, at the end, not once per token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokenizer_file import eot_id, load_tokenizer, vocab_bound
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.model.generate import generate_no_sync
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig
from gpuflow.train.resumed_data import check_checkpoint_tokenizer
from gpuflow.train.runfolder import TOKENIZER_FILE, open_run
from gpuflow.transfer.loader import upload_tokens
from gpuflow.transfer.mirror import read_now
from gpuflow.transfer.upload import place

# Generation has no cache: each token runs the model over up to model.max_len of them, and
# the text is printed only at the end, so far more would run for hours with nothing shown.
MAX_TOKENS = 10_000
# The seeds torch.manual_seed takes: a signed or an unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = ""
    max_tokens: int = 200
    temperature: float = 0.8  # 0 picks the most likely token every time
    top_k: int = 50  # 0 samples from the whole vocabulary
    seed: int = 0
    checkpoint: str = "best"  # best, latest, or a checkpoint's folder name (step_000300)

    def __post_init__(self) -> None:
        if not 0 < self.max_tokens <= MAX_TOKENS:
            raise GpuflowError(
                f"--max-tokens must be from 1 to {MAX_TOKENS:,}, got {self.max_tokens}; for "
                "longer text, sample again with the end of the last text as --prompt"
            )
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise GpuflowError(
                f"--seed must be from -2**63 to 2**64 - 1 (the seeds torch takes), got "
                f"{self.seed}; pass a seed in that range"
            )
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
    tokenizer (its tokens could not be turned into text) or not the one it was trained with
    (``check_tokenizer``), or its weights are not numbers."""
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
    try:  # the shape it was trained as, before a model of the config's is built
        ckpt.check_model_record(ckpt.read_record(checkpoint), run_config.model, checkpoint)
    except ckpt.CheckpointDamaged as exc:
        raise GpuflowError(f"{exc}; {_another(run_dir, checkpoint)}") from None
    model = GPT(run_config.model)
    try:
        record = ckpt.load_weights(checkpoint, model)
    except ckpt.CheckpointDamaged as exc:
        raise GpuflowError(f"{exc}; {_another(run_dir, checkpoint)}") from None
    check_finite(model, checkpoint, record)
    check_tokenizer(run_dir, run_config, record, say)  # names the data's to copy back
    check_checkpoint_tokenizer(run_dir, checkpoint, record.get("data"))  # without the data
    return run_dir, run_config, checkpoint, model


def check_tokenizer(
    run_dir: Path, run_config: RunConfig, record: dict, say: Callable[[str], None]
) -> None:
    """Refuse a run whose tokenizer.json is not the one it was trained with (its text would
    come out garbled, ids it lacks dropped): one with more tokens than the model has, or
    one that differs from the tokenizer of the data the run was trained on, where that
    data is still there as it was (as ``train --resume`` refuses it)."""
    path = run_dir / TOKENIZER_FILE
    vocab, model_vocab = vocab_bound(load_tokenizer(path)), run_config.model.vocab_size
    data_dir = run_config.data.resolved_dir(model_vocab)
    if vocab > model_vocab:
        raise GpuflowError(
            f"{path} has {vocab:,} tokens, more than the model's {model_vocab:,}: it is not "
            f"the tokenizer {run_dir} was trained with; copy the tokenizer.json of the data it "
            f"was trained on ({data_dir}) to {path}"
        )
    theirs = data_dir / TOKENIZER_FILE
    if not theirs.is_file() or theirs.read_bytes() == path.read_bytes():
        return  # no data left to compare with (a run may outlive it), or the same one
    trained_on = record.get("data")
    trained_on = trained_on.get("train_tokens") if isinstance(trained_on, dict) else None
    if trained_on is not None and trained_on == _train_tokens(data_dir):
        raise GpuflowError(
            f"{path} is not the tokenizer {run_dir} was trained with (that is {theirs}, of "
            f"its data); copy {theirs} to {path}"
        )
    # The data changed since (or an older checkpoint does not say): prepared again with
    # another tokenizer, maybe, which would make the run's the right one. Nothing here can
    # tell, so it is said, not refused.
    say(
        f"note: {path} differs from {theirs}, but {data_dir} is not known to be the data "
        f"{run_dir} was trained on (it changed since): cannot check that {path} is the "
        "tokenizer the run was trained with"
    )


def _train_tokens(data_dir: Path) -> int | None:
    """The train split's token count of the token folder ``data_dir``; None where it cannot
    be opened as one (what is wrong with it is for a run that trains on it to say)."""
    try:
        return TokenFolder.open(data_dir).train_tokens
    except (GpuflowError, OSError, ValueError):
        return None


def _file_ids(folder: Path) -> set[tuple[int, int]]:
    """(device, inode) of each file in ``folder``: which files two folders share."""
    ids = set()
    with suppress(OSError):
        for entry in os.scandir(folder):
            with suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    ids.add((stat.st_dev, stat.st_ino))
    return ids


def _another(run_dir: Path, damaged: Path) -> str:
    """What to do when ``damaged`` cannot be read: which checkpoints are left to choose."""
    others = [ckpt.best_checkpoint(run_dir), *ckpt.list_checkpoints(run_dir)]
    # ``best`` shares its files with its step's checkpoint (hard links): the same bytes
    damaged_files = _file_ids(damaged)
    names = [
        p.name for p in others
        if p is not None and p != damaged and not _file_ids(p) & damaged_files
    ]  # fmt: skip
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
    _say_unknown_ids(generated, vocab_bound(tokenizer), run_dir, say)
    return tokenizer.decode(prompt_ids[1:] + generated)


def _say_unknown_ids(ids: list[int], vocab: int, run_dir: Path, say: Callable[[str], None]) -> None:
    """Say that ids with no token in the tokenizer were drawn: decoding leaves them out. A
    model whose vocabulary is padded past its tokenizer's may draw one (rarely, once
    trained); many mean a tokenizer.json that is not the run's."""
    unknown = [i for i in ids if i >= vocab]
    if unknown:
        say(
            f"note: {len(unknown)} of the {len(ids)} tokens drawn (id {unknown[0]} first) are "
            f"not in {run_dir / TOKENIZER_FILE} ({vocab:,} tokens) and are left out of the "
            "text; if they are many, it is not the tokenizer the run was trained with"
        )
