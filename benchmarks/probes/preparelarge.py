"""Probe: gpuflow prepare alone on inputs too large for the baseline script (10 GiB, one 2 GiB
document, a repeated character): wall time and the peak RSS of its process tree, as JSON.

    PYTHONPATH=src python benchmarks/probes/preparelarge.py NAME --data PATH [prepare options]
"""

import json
import sys
from pathlib import Path

from gpuflow.bench.prepare import run_timed

name, args = sys.argv[1], sys.argv[2:]
out = Path(f"prepared-{name}")
command = [sys.executable, "-m", "gpuflow", "prepare", "--out", str(out), *args]
run = run_timed(command, Path.cwd())
meta = json.loads((out / "meta.json").read_text())
tokens = meta["train_tokens"] + meta["val_tokens"]
inputs = [Path(a) for a in args if Path(a).exists()]
size = sum(
    p.stat().st_size for a in inputs for p in ([a] if a.is_file() else a.rglob("*")) if p.is_file()
)
row = {
    "name": name,
    "command": " ".join(command[2:]),
    "seconds": run["seconds"],
    "peak_rss_bytes": run["peak_rss_bytes"],
    "tokens": tokens,
    "documents": meta["documents"],
    "forced_cuts": meta.get("forced_cuts"),
    "input_bytes": size,
    "mb_per_s": size / 1e6 / run["seconds"],
    "tokens_per_s": tokens / run["seconds"],
}
print(json.dumps(row))
