"""A reference loss curve, and a run's curve compared with it.

    python benchmarks/loss_curve.py store REF.json RUN SAME_SEED_RUN OTHER_SEED_RUN
    python benchmarks/loss_curve.py compare REF.json RUN

``store`` keeps RUN's train losses (every logging step) and validation losses, and two noise
bands: how far a second run of the same command strayed from it (the GPU's non-deterministic
reductions), and how far a run with another ``train.seed`` did. It never overwrites REF.json.

``compare`` prints the mean and largest |difference| of RUN's train losses from the
reference's at the steps both logged, and its final validation loss beside the reference's.
A run is "within run-to-run noise" when both figures are at most three times the same-seed
band's; it exits 1 otherwise, and 2 when the runs do not share their steps or config.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

TOLERANCE = 3.0  # times the same-seed band


def _read(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "train": {r["step"]: r["loss"] for r in records if "loss" in r},
        "val": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "config": tomllib.loads((run / "config.toml").read_text()),
    }


def _gap(a: dict[int, float], b: dict[int, float]) -> dict[str, float]:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise SystemExit("the runs share no logged step")
    gaps = [abs(a[s] - b[s]) for s in steps]
    return {"mean": sum(gaps) / len(gaps), "max": max(gaps), "steps": len(steps)}


def store(out: Path, run: Path, same_seed: Path, other_seed: Path) -> int:
    if out.exists():
        print(f"{out} exists; name a new file", file=sys.stderr)
        return 2
    ref, same, other = _read(run), _read(same_seed), _read(other_seed)
    record = {
        "run": run.name,
        "config": ref["config"],
        "train_loss": {str(s): v for s, v in ref["train"].items()},
        "val_loss": {str(s): v for s, v in ref["val"].items()},
        "noise": {
            "same_seed": _gap(ref["train"], same["train"]),
            "other_seed": _gap(ref["train"], other["train"]),
        },
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: {len(ref['train'])} train losses, noise {record['noise']}")
    return 0


def compare(reference: Path, run: Path) -> int:
    ref = json.loads(reference.read_text())
    got = _read(run)
    if got["config"]["model"] != ref["config"]["model"]:
        print("the run's model is not the reference's", file=sys.stderr)
        return 2
    gap = _gap({int(s): v for s, v in ref["train_loss"].items()}, got["train"])
    band = ref["noise"]["same_seed"]
    last_ref = max(ref["val_loss"], key=int)
    within = gap["mean"] <= TOLERANCE * band["mean"] and gap["max"] <= TOLERANCE * band["max"]
    print(
        f"train loss |difference| over {gap['steps']} steps: mean {gap['mean']:.4f}, max "
        f"{gap['max']:.4f} (same seed {band['mean']:.4f} / {band['max']:.4f}, another seed "
        f"{ref['noise']['other_seed']['mean']:.4f} / {ref['noise']['other_seed']['max']:.4f})"
    )
    print(
        f"final validation loss {got['val'].get(int(last_ref), float('nan')):.4f} at step "
        f"{last_ref}, reference {ref['val_loss'][last_ref]:.4f}"
    )
    print("within run-to-run noise" if within else "OUTSIDE run-to-run noise")
    return 0 if within else 1


if __name__ == "__main__":
    command, *paths = sys.argv[1:] or ["help"]
    if command == "store" and len(paths) == 4:
        sys.exit(store(*map(Path, paths)))
    if command == "compare" and len(paths) == 2:
        sys.exit(compare(*map(Path, paths)))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
