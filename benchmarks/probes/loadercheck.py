"""Probe: does every DeviceLoader batch arrive intact on the device, per variant (writer thread
or not, late copies or not, depth)? Prints the first wrong batch of each variant.

PYTHONPATH=src python3 benchmarks/probes/loadercheck.py
"""

import numpy as np
import torch

import gpuflow.transfer.loader as L

dev = torch.device("cuda")


def check(name, n_floats, n_batches, depth=2, late=False, writer=True):
    L._WRITER_MIN_BYTES = 1 << 20 if writer else 1 << 40
    source = (np.full(n_floats, float(i), dtype=np.float32) for i in range(n_batches))
    loader = L.DeviceLoader(source, "cuda", depth=depth)
    if late:
        pipeline = loader._pipeline
        issue = pipeline._issue

        def slow(crossing, stream):
            with torch.cuda.stream(pipeline.copy_stream):
                torch.cuda._sleep(10_000_000)
            return issue(crossing, stream)

        pipeline._issue = slow
    wrong = []
    with loader:
        for i, batch in enumerate(loader):
            torch.cuda.synchronize()
            if not bool((batch == float(i)).all()):
                wrong.append((i, batch[0].item(), batch[-1].item()))
    print(f"{name:40s} wrong: {len(wrong)} {wrong[:3]}", flush=True)


for late in (False, True):
    for writer in (True, False):
        for depth in (1, 2):
            check(f"16MiB late={late} writer={writer} depth={depth}", 1 << 22, 10, depth, late, writer)
    check(f"16KiB coalesced late={late}", 1 << 12, 200, 2, late)
