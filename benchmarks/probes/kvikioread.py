"""Probe: a token shard's payload read straight into device memory by kvikio, against
numpy.memmap + .to(); the tokens must match. Prints kvikio's mode (GDS or compat).

PYTHONPATH=src python3 benchmarks/probes/kvikioread.py SHARD.bin [repeats]
"""

import sys
import time

import kvikio
import kvikio.defaults
import numpy as np
import torch

from gpuflow.data.shards import HEADER_BYTES, Shard

shard = Shard.open(sys.argv[1])
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
itemsize = np.dtype(shard.dtype).itemsize
nbytes = shard.n_tokens * itemsize
offset = HEADER_BYTES  # the llm.c header
print("kvikio", kvikio.__version__, "compat mode:", kvikio.defaults.get("compat_mode"))
target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
for r in range(repeats):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with kvikio.CuFile(str(shard.path), "r") as f:
        got = f.pread(target, nbytes, offset).get()
    torch.cuda.synchronize()
    kv = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = torch.from_numpy(np.asarray(shard.tokens).view(np.uint8)).to("cuda")
    torch.cuda.synchronize()
    mm = time.perf_counter() - t0
    same = torch.equal(ref, target)
    print(
        f"round {r}: {nbytes / 1e6:.1f} MB kvikio {nbytes / kv / 1e9:.2f} GB/s ({got} B), "
        f"memmap+.to() {nbytes / mm / 1e9:.2f} GB/s, identical {same}"
    )
