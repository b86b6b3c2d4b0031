"""What to say about a config key that does not exist: where it lives when it was put in
the wrong section (or at the top of a TOML file), and what nanoGPT's names for settings are
called here, or that the model has no such thing."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

# nanoGPT's train.py settings -> what gpuflow calls them ("-: why" where there is none)
NANOGPT_NAMES = {
    "learning_rate": "train.lr",
    "n_embd": "model.d_model",
    "block_size": "model.max_len",
    "min_lr": "train.min_lr_ratio (the floor as a fraction of train.lr: min_lr / lr)",
    "warmup_iters": "train.warmup_steps",
    "lr_decay_iters": "train.decay_steps",
    "max_iters": "train.steps (or --steps)",
    "gradient_accumulation_steps": (
        "train.batch_tokens (a step's tokens over the job: batch_size x max_len x "
        "micro-batches x ranks)"
    ),
    "eval_iters": "train.eval_batches",
    "init_from": "--resume (continues a gpuflow run; pretrained weights are not loaded)",
    "decay_lr": "train.min_lr_ratio = 1 (the rate stays constant after the warm-up)",
    "dropout": "-: the model has no dropout",
    "bias": "-: the model's linear layers have no bias",
    "dtype": "-: CUDA trains in bf16 autocast, other devices in fp32",
    "always_save_checkpoint": "train.checkpoint_interval (the best one is kept apart)",
    "out_dir": "--name (runs live in runs/<name>)",
    "dataset": "data.dir (a folder gpuflow prepare wrote, or llm.c's shards)",
}


def unknown_key_hint(section: str, key: str, sections: Mapping[str, tuple[str, ...]]) -> str:
    """A clause to add to an unknown-key error (empty when there is nothing to say);
    ``sections`` maps each section to its keys."""
    if key in NANOGPT_NAMES:
        return f"; {nanogpt_hint(key)}"
    owners = [name for name, keys in sections.items() if key in keys and name != section]
    if owners:
        return f"; {key} is a key of [{owners[0]}]: {owners[0]}.{key}"
    every = [f"{name}.{k}" for name, keys in sections.items() for k in keys]
    close = difflib.get_close_matches(f"{section}.{key}", every, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def top_level_hint(key: str, sections: Mapping[str, tuple[str, ...]]) -> str:
    """A clause for a TOML name at the top of the file that is not a section."""
    owners = [name for name, keys in sections.items() if key in keys]
    if owners:
        return f"; {key} is a key of [{owners[0]}]: put it under a [{owners[0]}] header"
    return f"; {nanogpt_hint(key)}" if key in NANOGPT_NAMES else ""


def nanogpt_hint(key: str) -> str:
    """What nanoGPT's setting ``key`` (one of ``NANOGPT_NAMES``) is called here."""
    name = NANOGPT_NAMES[key]
    if name.startswith("-: "):  # no counterpart
        return f"nanoGPT's {key} has no counterpart here{name[1:]}"
    return f"nanoGPT's {key} is {name} here"
