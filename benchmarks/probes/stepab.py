"""Probe: the captured training step built different ways, A/B in one process.

Each variant is a ``StepOptions`` (what the trainer's step is built from) plus, for the
attention variants, torch's own SDPA switches:
main: what the trainer does (fused head and clip, combo kernels, FlexAttention at T <= its
limit, bf16 weights over fp32 masters updated by MasterAdamW's one kernel);
adamw: main with fused AdamW over fp32 weights (no MasterAdamW);
clip: main with clip_grad_norm_ (a pass over the gradients) instead of the clip's factor
handed to the optimizer;
nocombo: main without inductor's combo kernels;
cdt: main with inductor's coordinate-descent tuning of its own kernels;
autotune: main with inductor's matrix-product autotuning;
mor: main with inductor's mixed-order reductions;
aggressive: main with inductor's aggressive fusion (fusing kernels that share no reads);
multikernel: main with inductor's multi-kernels (persistent and looped forms of each reduction
compiled, the faster chosen by timing them);
combo: main with combo kernels whose parts share one block size (main before their own);
nodes16: main with up to 16 kernels combined into one (8 by default);
autotune2: main with combo kernels of foreach operations autotuned too;
benchcombo: main keeping only the combo kernels that time faster than their parts;
flash: main with cuDNN's attention switched off in torch's SDPA (its flash kernel instead),
for contexts past FlexAttention's limit;
inductor: main with FlexAttention's kernels at inductor's default blocks (at T 128 its H100
defaults make one forward program per batch row and head: 192 for 132 SMs);
flexfwd32, flexbwd32, flexmid, flexsafe: main's FlexAttention blocks changed (forward rows
of 32; backward blocks of 32; forward 64 x 128 and backward 64s), or told that every causal
row has a key to attend to.
Variants alternate over rounds in one process, resident-graph, compiled. Earlier variants
(the unfused head, the fp32 residual stream, cuDNN/flash/math attention) and their figures
are in docs/decisions/010 and its neighbours.

PYTHONPATH=src python3 benchmarks/probes/stepab.py PRESET [out.json] [rounds] [variants]
    [key=value ...]
"""

import sys
import tempfile

import torch
from abrows import measure_row

from gpuflow.device.accelerator import Device
from gpuflow.model import gpt
from gpuflow.train.config import resolve_config
from gpuflow.train.step import COMPILE_OPTIONS, StepOptions, known_to_inductor


def compiled_with(**extra) -> StepOptions:
    return StepOptions(compile_options={**COMPILE_OPTIONS, **extra})


VARIANTS = {
    "main": StepOptions(),
    "adamw": StepOptions(master_weights=False),
    "clip": StepOptions(fused_clip=False),
    "nocombo": compiled_with(combo_kernels=False),
    "cdt": compiled_with(coordinate_descent_tuning=True),
    "autotune": compiled_with(max_autotune=True),
    "mor": compiled_with(**{"triton.mix_order_reduction": True}),
    "aggressive": compiled_with(aggressive_fusion=True),
    "multikernel": compiled_with(**{"triton.multi_kernel": 1}),
    "combo": StepOptions(compile_options={"combo_kernels": True}),
    "nodes16": compiled_with(combo_kernel_max_num_nodes=16),
    "autotune2": compiled_with(combo_kernels_autotune=2),
    "benchcombo": compiled_with(benchmark_combo_kernel=True),
}
MAIN_FLEX = dict(gpt.FLEX_KERNEL_OPTIONS)
FLEX = {
    "inductor": {},
    "flexfwd32": {**MAIN_FLEX, "fwd_BLOCK_M": 32},
    "flexbwd32": {**MAIN_FLEX, "BLOCK_N1": 32, "BLOCK_M2": 32},
    "flexmid": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3,
                "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                "bwd_num_warps": 4, "bwd_num_stages": 3},
    "flexsafe": {**MAIN_FLEX, "ROWS_GUARANTEED_SAFE": True},
}  # fmt: skip
ATTENTION = ("flash", *FLEX)

preset = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else None
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else ["adamw", "main"]
overrides = sys.argv[5:]
config = resolve_config(preset, None, [*overrides, "train.steps=200"])
device = Device.resolve("auto")
rows = []
meta = {"preset": preset, "overrides": overrides}
with tempfile.TemporaryDirectory() as scratch:
    for r in range(rounds):
        for label in chosen:
            # the attention variants are main's options under other attention switches
            options = VARIANTS["main" if label in ATTENTION else label]
            wanted = options.compile_options
            unknown = set(wanted) - set(known_to_inductor(wanted))
            if unknown:
                print(f"{label}: this torch has no inductor option {unknown}; skipped")
                continue
            torch.backends.cuda.enable_cudnn_sdp(label != "flash")  # read when it compiles
            gpt.FLEX_KERNEL_OPTIONS.clear()
            gpt.FLEX_KERNEL_OPTIONS.update(FLEX.get(label, MAIN_FLEX))
            measure_row(config, device, label, r, scratch, rows, out, meta, options)
