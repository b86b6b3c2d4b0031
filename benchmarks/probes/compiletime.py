"""Probe: how long a run waits for its first logging interval, by inductor options.

Each setting trains seed-d384 for 30 steps with a cold inductor cache of its own.

PYTHONPATH=src python3 benchmarks/probes/compiletime.py  (one setting per process)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "combo": {"combo_kernels": True},
    "combo+tuning": {"combo_kernels": True, "coordinate_descent_tuning": True},
}

if len(sys.argv) == 1:
    for name in SETTINGS:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor-{name}"}
        subprocess.run([sys.executable, __file__, name], env=env, check=True)
    sys.exit()

from gpuflow.device.accelerator import Device  # noqa: E402
from gpuflow.train.config import resolve_config  # noqa: E402
from gpuflow.train.step import StepOptions  # noqa: E402
from gpuflow.train.trainer import Trainer  # noqa: E402

name = sys.argv[1]
options = StepOptions(compile_options=SETTINGS[name])
run_dir = Path(f"/tmp/compiletime-{name}")
config = resolve_config("seed-d384", None, ["train.steps=30"])
started = time.time()
result = Trainer(config, run_dir, Device.resolve("auto"), options).run()
lines = (run_dir / "metrics.jsonl").read_text().splitlines()
first = next(json.loads(line) for line in lines if "tokens_per_s" in line)
print(
    f"{name}: first interval at {first['elapsed_s']:.1f} s, whole run "
    f"{time.time() - started:.1f} s, median {result.tokens_per_s:,.0f} tokens/s"
)
