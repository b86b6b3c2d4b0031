"""A stand-in for a nanoGPT checkout, for ``gpuflow bench reference`` on CI (which has none):
a ``configurator.py`` that takes ``--key=value`` flags as nanoGPT's does (``literal_eval``,
and the type of train.py's default or an error), and a ``train.py`` with nanoGPT's globals
that checks the data the bench wrote (``data/<dataset>/train.bin`` and ``val.bin`` of uint16
tokens below ``meta.pkl``'s vocab_size) and prints nanoGPT's lines, with losses that fall.
It imports numpy only, so that it starts in a moment."""

from __future__ import annotations

from pathlib import Path

CONFIGURATOR = """
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    assert arg.startswith("--") and "=" in arg, arg
    key, val = arg.split("=")
    key = key[2:]
    if key not in globals():
        raise ValueError(f"Unknown config key: {key}")
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val
    assert type(attempt) == type(globals()[key]), (key, attempt)
    globals()[key] = attempt
"""

TRAIN = """
import os
import pickle

import numpy as np

out_dir = "out"
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False
always_save_checkpoint = True
init_from = "scratch"
wandb_log = False
dataset = "openwebtext"
gradient_accumulation_steps = 40
batch_size = 12
block_size = 1024
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
device = "cuda"
dtype = "bfloat16"
compile = True
FAIL = ""
exec(open("configurator.py").read())

data_dir = os.path.join("data", dataset)
with open(os.path.join(data_dir, "meta.pkl"), "rb") as f:
    vocab_size = pickle.load(f)["vocab_size"]
for split in ("train", "val"):
    path = os.path.join(data_dir, f"{split}.bin")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    assert os.path.getsize(path) == 2 * len(data) > 2 * block_size, path
    assert int(data.max()) < vocab_size, f"{path} holds ids beyond {vocab_size}"
if FAIL:
    raise ValueError(FAIL)
print(f"tokens per iteration will be: {gradient_accumulation_steps * batch_size * block_size:,}")
os.makedirs(out_dir, exist_ok=True)
for iter_num in range(max_iters + 1):
    loss = 6.0 - 0.1 * iter_num
    if iter_num % eval_interval == 0:
        print(f"step {iter_num}: train loss {loss + 0.01:.4f}, val loss {loss:.4f}")
    if iter_num % log_interval == 0:
        print(f"iter {iter_num}: loss {loss:.4f}, time {10 + iter_num:.2f}ms, mfu -100.00%")
"""


def write_standin(folder: Path, fail: str = "") -> Path:
    """The stand-in checkout in ``folder``; ``fail``: its train.py raises that, after reading
    its flags and checking the data."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configurator.py").write_text(CONFIGURATOR)
    train = TRAIN.replace('FAIL = ""', f"FAIL = {fail!r}")
    (folder / "train.py").write_text(train)
    (folder / "model.py").write_text("# nanoGPT's model; the stand-in trains nothing\n")
    return folder
