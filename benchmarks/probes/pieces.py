"""Probe: how many pieces the split update's all-gather is cut into (``SHARD_PIECES``).

Runs the gpuflow command line given after PIECES with ``master_adamw.SHARD_PIECES`` set to
PIECES; meant to run under torchrun with 2 processes, several values alternating over
rounds, reading each run's tokens/s from its report.json.

torchrun --standalone --nproc_per_node=2 benchmarks/probes/pieces.py PIECES train ARGS...
PYTHONPATH=src python3 benchmarks/probes/pieces.py collect OUT.json runs/p*
"""

import json
import sys
from pathlib import Path


def collect(out: str, run_dirs: list[str]) -> None:
    rows = []
    for run_dir in run_dirs:
        report = json.loads((Path(run_dir) / "report.json").read_text())
        rows.append({
            "run": Path(run_dir).name,
            "tokens_per_s": report["tokens_per_s"],
            "world_size": report["world_size"],
            "final_train_loss": report.get("final_train_loss"),
        })  # fmt: skip
    Path(out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    for row in rows:
        print(f"{row['run']:>12} {row['tokens_per_s']:>12,.0f} tokens/s")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(sys.argv[2], sys.argv[3:])
    else:
        from gpuflow.interface.cli.main import main
        from gpuflow.train.optim import master_adamw

        master_adamw.SHARD_PIECES = int(sys.argv[1])
        sys.exit(main(sys.argv[2:]))
