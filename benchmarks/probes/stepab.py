"""Probe: the captured training step with and without the fused head and the clip in AdamW.

before: F.linear + F.cross_entropy head, clip_grad_norm_ (a pass over the gradients);
head: gpuflow.model.head.linear_cross_entropy, clip_grad_norm_;
head+clip: the fused head and the clip's factor passed to fused AdamW as grad_scale;
main: what the trainer does (head+clip, combo kernels, the model's own attention, bf16
weights over fp32 masters updated by MasterAdamW's one kernel);
adamw: main with fused AdamW over fp32 weights, as the step was before MasterAdamW (every
variant but main still runs that way);
cdt: main with inductor's coordinate-descent tuning of its own kernels;
flash: main with cuDNN's attention turned off (flash attention instead);
autotune: main with inductor's matrix-product autotuning;
fp32res: main with the residual stream kept in fp32 (as it was before the trunk cast it to
autocast's dtype);
math: main with attention as plain matrix products and a softmax (no fused attention kernel);
mor: main with inductor's mixed-order reductions (a LayerNorm backward and its weight
gradient's column sums in one kernel); mor-nocombo: the same without combo kernels;
cudnn: main with cuDNN's attention through scaled_dot_product_attention, as the model had it
before FlexAttention (every variant but main and fp32res still runs that way).
Variants alternate over two rounds in one process, resident-graph, compiled.

PYTHONPATH=src python3 benchmarks/probes/stepab.py PRESET [out.json] [rounds] [variants]
    [key=value ...]
"""

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from abrows import measure_row

import gpuflow.model.gpt as model_module
from gpuflow.device.accelerator import Device
from gpuflow.train.config import resolve_config
from gpuflow.train.master_adamw import MasterAdamW
from gpuflow.train.trainer import Trainer

fused_head = model_module.linear_cross_entropy
fused_update = Trainer._update
autocast_trunk = model_module.GPT.trunk
flex_max_len = model_module.FLEX_MAX_LEN
master_runs_on = MasterAdamW.runs_on


def fp32_trunk(self, x):
    for block in self.blocks:
        x = block(x)
    return self.ln_f(x)


def stock_head(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def stock_update(self):
    norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    return norm


plain_compile = torch.compile


def compile_with(**extra):
    """torch.compile with the trainer's options plus ``extra``."""

    def compile_fn(fn, options=None, **kwargs):
        return plain_compile(fn, options={**(options or {}), **extra}, **kwargs)

    return compile_fn


@dataclass(frozen=True)
class Variant:
    """One way to build the step; the defaults are main's pieces before FlexAttention."""

    head: Callable = fused_head
    update: Callable = fused_update
    compile: Callable = plain_compile
    attention: str = "cudnn"  # model (its own choice), cudnn, flash or math
    trunk: Callable = autocast_trunk
    master_weights: bool = False  # MasterAdamW (else fused AdamW over fp32 weights)


NO_COMBO = compile_with(combo_kernels=False)
VARIANTS = {
    "before": Variant(head=stock_head, update=stock_update, compile=NO_COMBO),
    "head": Variant(update=stock_update, compile=NO_COMBO),
    "head+clip": Variant(compile=NO_COMBO),
    "main": Variant(attention="model", master_weights=True),
    "adamw": Variant(attention="model"),
    "cudnn": Variant(),
    "cdt": Variant(compile=compile_with(coordinate_descent_tuning=True)),
    "flash": Variant(attention="flash"),
    "autotune": Variant(compile=compile_with(max_autotune=True)),
    "fp32res": Variant(attention="model", trunk=fp32_trunk),
    "math": Variant(attention="math"),
    "mor": Variant(compile=compile_with(**{"triton.mix_order_reduction": True})),
    "mor-nocombo": Variant(
        compile=compile_with(**{"triton.mix_order_reduction": True, "combo_kernels": False})
    ),
}

preset = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else None
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else ["before", "main"]
overrides = sys.argv[5:]
config = resolve_config(preset, None, [*overrides, "train.steps=200"])
device = Device.resolve("auto")
rows = []
with tempfile.TemporaryDirectory() as scratch:
    for r in range(rounds):
        for label in chosen:
            variant = VARIANTS[label]
            attention = variant.attention
            model_module.GPT.trunk = variant.trunk
            # Any attention but the model's own choice is SDPA: FlexAttention switched off.
            model_module.FLEX_MAX_LEN = flex_max_len if attention == "model" else 0
            model_module.linear_cross_entropy = variant.head
            Trainer._update = variant.update
            MasterAdamW.runs_on = staticmethod(
                master_runs_on if variant.master_weights else lambda _device: False
            )
            torch.compile = variant.compile
            torch.backends.cuda.enable_cudnn_sdp(attention == "cudnn")
            torch.backends.cuda.enable_flash_sdp(attention != "math")
            torch.backends.cuda.enable_mem_efficient_sdp(attention != "math")
            meta = {"preset": preset, "overrides": overrides}
            measure_row(config, device, label, r, scratch, rows, out, meta)
