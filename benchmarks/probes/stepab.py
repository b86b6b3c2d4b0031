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
mor: main with inductor's mixed-order reductions.
Variants alternate over rounds in one process, resident-graph, compiled. Earlier variants
(the unfused head, the fp32 residual stream, cuDNN/flash/math attention) and their figures
are in benchmarks/NOTES.md.

PYTHONPATH=src python3 benchmarks/probes/stepab.py PRESET [out.json] [rounds] [variants]
    [key=value ...]
"""

import sys
import tempfile

from abrows import measure_row

from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config
from gpuflow.train.step import COMPILE_OPTIONS, StepOptions


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
}

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
            measure_row(config, device, label, r, scratch, rows, out, meta, VARIANTS[label])
