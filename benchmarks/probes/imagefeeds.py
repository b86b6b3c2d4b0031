"""Probe: the image loop (a ``DataLoader`` with 6 workers, the small CNN, batches of B
3x64x64 uint8 images) through DeviceLoader, against the idiom
(``DataLoader(pin_memory=True)`` + ``.to()``) in PAIRS pairs of rounds whose order
alternates; the median of the pairs' ratios. Appends its lines to OUT.

Feeds: ``deviceloader`` (over ``DataLoader(pin_memory=False)``, as a user passes it),
``pinned_source`` (over ``DataLoader(pin_memory=True)``), ``depth1`` and ``depth0``
(``depth=1``: one copy queued ahead, not two; ``depth=0``: none, each batch read when asked
for, as the idiom reads it) and ``torchcopies`` (``GPUFLOW_TORCH_COPIES=1``: torch's copies
instead of driver calls), ``alldirect`` (every pinned tensor copied where it lies, the
labels too: no staging buffer, ``DIRECT_MIN_BYTES`` set to 0). Idiom variants that ask what
slows a loop fed this way: ``idiom_spin`` (the idiom plus SPIN_US of Python work holding the
interpreter lock per batch), ``idiom_rest`` (plus a sleep as long, the lock let go) and
``idiom_sidestream`` (the idiom's copies on a side stream, as DeviceLoader issues them).
SWITCH_US sets the interpreter's forced hand-off interval (``sys.setswitchinterval``).

The ``reader``, ``threaded`` and ``threaded_pinall`` rows of
``benchmarks/results/2026-11-26-probe-imagefeeds-h100.txt`` came from an earlier form of
this probe, at commit 46a03dc, that switched the loader to the ways it read a worker-fed
source then: the whole crossing on a thread of its own (``transfer/device_reader.py``, the
default), or a thread only taking batches and pinning those of 256 KiB or more
(``threaded``) or all of them (``threaded_pinall``, ``ThreadedSource`` in
``transfer/reader.py``). Cited by docs/decisions/039 and 042.

PYTHONPATH=src python3 benchmarks/probes/imagefeeds.py OUT B PAIRS FEED...
"""

import os
import sys
import time

import torch

from gpuflow.bench.loaders import SyntheticImages, paired_rounds, small_cnn, train_images
from gpuflow.device.accelerator import Device
from gpuflow.transfer import packing
from gpuflow.transfer.loader import DeviceLoader

default_direct_min = packing.DIRECT_MIN_BYTES

dev = Device.resolve("cuda")
model = small_cnn().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
B, PAIRS = int(sys.argv[2]), int(sys.argv[3])
steps = 240
data = SyntheticImages(B * (steps + 30), 64)


def source(pin):
    return torch.utils.data.DataLoader(
        data, batch_size=B, num_workers=6, pin_memory=pin, prefetch_factor=4
    )


def idiom():
    feed = ({k: v.to("cuda", non_blocking=True) for k, v in b.items()} for b in source(True))
    return train_images(dev, feed, model, opt, 30)


def idiom_with(extra):
    def feed():
        for b in source(True):
            extra()
            yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}

    return train_images(dev, feed(), model, opt, 30)


def spin():  # holds the interpreter lock for SPIN_US, as Python work on the training thread
    end = time.perf_counter() + SPIN_US / 1e6
    while time.perf_counter() < end:
        pass


def rest():  # lets go of the lock for about SPIN_US, as a wait would
    time.sleep(SPIN_US / 1e6)


def idiom_side_stream():
    copies = torch.cuda.Stream()

    def feed():
        for b in source(True):
            with torch.cuda.stream(copies):
                placed = {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
            torch.cuda.current_stream().wait_stream(copies)
            for v in placed.values():
                v.record_stream(torch.cuda.current_stream())
            yield placed

    return train_images(dev, feed(), model, opt, 30)


def ours(pin, **options):
    with DeviceLoader(source(pin), dev, **options) as loader:
        return train_images(dev, loader, model, opt, 30)


def all_direct():
    packing.DIRECT_MIN_BYTES = 0  # every pinned tensor copied where it lies: no staging
    try:
        return ours(False)
    finally:
        packing.DIRECT_MIN_BYTES = default_direct_min


def torch_copies():
    os.environ["GPUFLOW_TORCH_COPIES"] = "1"  # read when a loader is made
    try:
        return ours(False)
    finally:
        del os.environ["GPUFLOW_TORCH_COPIES"]


variants = {
    "deviceloader": lambda: ours(False),
    "pinned_source": lambda: ours(True),
    "depth1": lambda: ours(False, depth=1),
    "depth0": lambda: ours(False, depth=0),
    "torchcopies": torch_copies,
    "alldirect": all_direct,
    "idiom_spin": lambda: idiom_with(spin),
    "idiom_rest": lambda: idiom_with(rest),
    "idiom_sidestream": idiom_side_stream,
}
SPIN_US = float(os.environ.get("SPIN_US", "50"))
if "SWITCH_US" in os.environ:  # the interpreter's forced hand-off interval (default 5 ms)
    sys.setswitchinterval(float(os.environ["SWITCH_US"]) / 1e6)
chosen = sys.argv[4:]
idiom()
for name in chosen:  # untimed warm-up
    variants[name]()
lines = []
for name in chosen:
    paired = paired_rounds(idiom, variants[name], PAIRS, "idiom", "images")
    lines.append(
        f"B={B} switch={sys.getswitchinterval() * 1e6:.0f}us {name}: "
        f"median pair ratio {paired['speedup']:.3f} "
        f"pairs {[round(r, 3) for r in paired['pair_ratios']]}"
    )
    print(lines[-1], flush=True)
with open(sys.argv[1], "a") as out:
    out.write("\n".join(lines) + "\n")
