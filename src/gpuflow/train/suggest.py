"""The ``gpuflow train`` command to suggest for a token folder, without loading torch.

``gpuflow prepare`` ends by naming the command that trains on what it wrote; the presets
live in ``train/config.py``, whose imports load torch (seconds on a host without cached
bytecode), which a command that only tokenizes should not pay. Their vocabularies are kept
here, in preset order; a test checks them against the presets.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from gpuflow.common.sizes import round_up

# Each preset's model.vocab_size, as train/config.py's PRESETS give them.
PRESET_VOCAB_SIZES = {
    "tiny": 4096,
    "seed-d512": 16000,
    "seed-d384": 16000,
    "seed-d256": 16000,
    "gpt2-124m": 50304,
    "gpt2-350m": 50304,
    "gpt2-774m": 50304,
    "gpt2-1558m": 50304,
}

# Each preset's model.max_len: a split shorter than one window of max_len + 1 tokens trains
# nothing, so prepare says so rather than suggest a command that stops.
PRESET_MAX_LENS = {
    "tiny": 128,
    "seed-d512": 512,
    "seed-d384": 128,
    "seed-d256": 128,
    "gpt2-124m": 1024,
    "gpt2-350m": 1024,
    "gpt2-774m": 1024,
    "gpt2-1558m": 1024,
}

# What the tiny preset costs where there is no GPU (README, "Two commands").
TINY_ON_CPU = "tiny: 300 steps, about 80 seconds on 2 CPU cores at its 4,096-token vocabulary"


def gpu_present() -> bool:
    """Whether this host shows a GPU to its programs (an NVIDIA or AMD device node), checked
    without loading torch."""
    return any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))


def train_command(vocab_size: int, data_dir: str | Path, gpu: bool = True) -> str:
    """The ``gpuflow train`` command line for a token folder of ``vocab_size`` tokens: with a
    GPU, a preset of that vocabulary as it is (seed-d384, the reference configuration, first
    among equals); else, or without such a preset, ``tiny`` with its vocabulary raised to a
    multiple of 64 that holds it."""
    data = shlex.quote(f"data.dir={data_dir}")
    name = suggested_preset(vocab_size, gpu)
    if PRESET_VOCAB_SIZES[name] == vocab_size:
        return f"gpuflow train --preset {name} --set {data}"
    vocab = round_up(vocab_size, 64)
    return f"gpuflow train --preset tiny --set {data} --set model.vocab_size={vocab}"


def suggested_preset(vocab_size: int, gpu: bool = True) -> str:
    """The preset ``train_command`` names for a token folder of ``vocab_size`` tokens."""
    exact = [name for name, size in PRESET_VOCAB_SIZES.items() if size == vocab_size]
    if exact and (gpu or "tiny" in exact):
        return sorted(exact, key=lambda n: n != "seed-d384")[0]
    return "tiny"


def short_split_note(preset: str, train_tokens: int, val_tokens: int) -> str | None:
    """A line saying which split holds fewer tokens than one of ``preset``'s windows (the
    suggested command would stop at once), or None when both hold one."""
    window = PRESET_MAX_LENS[preset] + 1
    sizes = {"train": train_tokens, "val": val_tokens}
    short = {split: n for split, n in sizes.items() if n < window}
    if not short:
        return None
    splits = " and ".join(
        f"the {split} split holds {n:,} token{'' if n == 1 else 's'}" for split, n in short.items()
    )
    return (
        f"note: {splits}, fewer than one window of {preset} ({window:,} tokens), so the command "
        "above would stop at once: add text"
    )
