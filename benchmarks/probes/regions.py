"""Probe: what compiling the model region by region costs the captured step on one GPU.

Overlapping the gradients' reduction with the backward needs the backward in pieces, and the
whole-model compile makes it one (docs/decisions/029). This measures the pieces' own price,
with no collective at all: the resident-graph step of a preset with the model compiled
whole (main) and as regions: the embedding, the blocks in N groups, and the final norm with
the fused head, each compiled on its own (regions-N; regions-L is one region per block).
Variants alternate over rounds in one process.

PYTHONPATH=src python3 benchmarks/probes/regions.py PRESET [out.json] [rounds] [variants]
"""

import math
import sys
import tempfile
from typing import Any

import torch
from abrows import measure_row

from gpuflow.device.accelerator import Device
from gpuflow.model.head import linear_cross_entropy
from gpuflow.train import trainer as trainer_module
from gpuflow.train.config import resolve_config

whole_model = trainer_module.compiled_forward


def regional(groups_of_blocks: int) -> Any:
    """A ``compiled_forward`` that compiles the embedding, ``groups_of_blocks`` groups of
    blocks and the head apart."""

    def build(model: torch.nn.Module, device: Device, options: Any) -> Any:
        torch._dynamo.reset()
        opts = dict(options.compile_options)
        blocks = list(model.blocks)
        size = math.ceil(len(blocks) / groups_of_blocks)
        groups = [
            torch.compile(torch.nn.Sequential(*blocks[i : i + size]), options=opts)
            for i in range(0, len(blocks), size)
        ]
        embed = torch.compile(model.embed, options=opts)

        def head(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return linear_cross_entropy(
                model.ln_f(x).flatten(0, 1), model.wte.weight, targets.flatten()
            )

        compiled_head = torch.compile(head, options=opts)

        def forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = embed(idx)  # (B, T, C)
            if torch.is_autocast_enabled("cuda"):  # as GPT.trunk carries the residual stream
                x = x.to(torch.get_autocast_dtype("cuda"))
            for group in groups:
                x = group(x)
            return compiled_head(x, targets)

        return forward

    return build


def main() -> None:
    preset = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else None
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    config = resolve_config(preset)
    layers = config.model.n_layer
    builders = {"main": whole_model, "regions-1": regional(1), "regions-2": regional(2)}
    builders[f"regions-{layers}"] = regional(layers)
    wanted = sys.argv[4].split(",") if len(sys.argv) > 4 else list(builders)
    device = Device.resolve("cuda")
    meta = {"probe": "regions", "preset": preset, "device": torch.cuda.get_device_name()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            for label in wanted:
                trainer_module.compiled_forward = builders[label]
                try:
                    measure_row(config, device, label, r, scratch, rows, out, meta)
                finally:
                    trainer_module.compiled_forward = whole_model


if __name__ == "__main__":
    main()
