"""gpuflow's layers, bottom first: the folders of ``src/gpuflow``, in the order data flows.

A module imports only from its own layer and those below it (``tests/project/test_architecture.py``
checks this), and only the layers in ``CROSSING`` move bytes between host and device.
``bench`` and ``interface`` sit on top: they measure and drive everything else. The
baselines the benches measure against (the naive and standard data paths) are bench code,
registered with the trainer from there, so no layer below ``bench`` loads them.
"""

from __future__ import annotations

LAYERS = (
    "common",  # errors, atomic writes, consoles: shared by every layer
    "device",
    "accounting",  # below transfer: the transfer and data layers report copies to its tally
    "transfer",  # the memory layer (pinned pools) lives here too
    "data",
    "model",
    "train",
    "bench",
    "interface",
)

# The layers whose job is to cross the bus: everything else asks them.
CROSSING = ("transfer", "data")

# The layers the ledger looks through when it names where an operation came from: their
# frames are the means of a crossing, the caller above them is its cause.
LOOKED_THROUGH = ("common", "device", "transfer", "accounting")
