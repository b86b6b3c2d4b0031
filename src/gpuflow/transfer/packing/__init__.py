"""Coalesce a whole batch into one buffer, cross the bus once, rebuild it on the device.

``pack`` lays every tensor of a nested batch (dicts, lists, tuples, namedtuples, dataclasses,
``Ragged`` integer sequences) end to end in one host buffer, narrowing on the way; ``unpack``
turns one device copy of that buffer back into the same structure, as views of it. Codecs:
integer narrowing (on by default, range-checked on every batch) and ``lossy_float`` (opt-in);
uint8 and bool cross as they are.

The parts, in the order a batch meets them: ``spec`` (what a packed batch is made of),
``codecs`` (the dtype each tensor crosses in), ``plan`` (a batch laid out), ``write`` (the
host buffer filled), ``rebuilding`` (the batch rebuilt from the buffer). Why one copy, what
each codec does, and what is passed through or refused: docs/architecture/transfer-pipeline.md
(Packing a batch into one buffer).
"""

from __future__ import annotations

from gpuflow.transfer.packing.codecs import LOSSY_FLOATS, LossyFloat
from gpuflow.transfer.packing.plan import (
    DIRECT_MIN_BYTES,
    PIN_MIN_BYTES,
    Crossing,
    Planner,
    pack,
    plan_pack,
)
from gpuflow.transfer.packing.rebuilding import rebuild, rebuild_run, unpack
from gpuflow.transfer.packing.spec import ALIGN, SIDE_STREAM_BYTES, Leaf, PackLayout, Ragged
from gpuflow.transfer.packing.write import Packed, PackPlan

__all__ = [
    "ALIGN",
    "DIRECT_MIN_BYTES",
    "LOSSY_FLOATS",
    "PIN_MIN_BYTES",
    "SIDE_STREAM_BYTES",
    "Crossing",
    "Leaf",
    "LossyFloat",
    "PackLayout",
    "PackPlan",
    "Packed",
    "Planner",
    "Ragged",
    "pack",
    "plan_pack",
    "rebuild",
    "rebuild_run",
    "unpack",
]
