#!/usr/bin/env bash
# Probe: a 2-GPU seed-d384 run killed with kill -9 on rank 1 mid-run; both processes must
# exit; --resume then continues from the last checkpoint on 2 GPUs (to step 800) and on 1
# (to step 1000). Writes its log to $1 (default: kill.log).
#   PYTHONPATH=src bash benchmarks/probes/killrank.sh OUT.log
log=${1:-kill.log}
run=runs/killrank
rm -rf "$run"
sets=(--set train.checkpoint_interval=200 --set train.eval_interval=200)
torchrun --nproc_per_node=2 -m gpuflow train --preset seed-d384 --steps 1000 --name killrank \
  "${sets[@]}" >"$log.first" 2>&1 &
launcher=$!
until [ -d "$run/checkpoints/step_000400" ] || ! kill -0 $launcher 2>/dev/null; do sleep 0.05; done
victim=""
for p in $(pgrep -f "gpuflow train"); do
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'LOCAL_RANK=1'; then victim=$p; fi
done
{
  echo "checkpoints when killing: $(ls "$run/checkpoints" 2>/dev/null | tr '\n' ' ')"
  echo "last metrics step: $(grep -o '"step": [0-9]*' "$run/metrics.jsonl" | tail -1)"
  [ -n "$victim" ] && kill -9 "$victim" && echo "kill -9 rank 1 (pid $victim) at $(date +%T.%N)"
  start=$(date +%s.%N)
  wait $launcher; rc=$?
  echo "torchrun exited rc=$rc after $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
  sleep 1
  left=$(pgrep -f "gpuflow train" | tr '\n' ' ')
  echo "gpuflow processes left: ${left:-none}"
  echo "checkpoints after: $(ls "$run/checkpoints" | tr '\n' ' ')"
  echo "--- resume on 2 GPUs to step 800"
  torchrun --nproc_per_node=2 -m gpuflow train --resume --name killrank --steps 800 --set train.decay_steps=1000 2>&1 | grep -E "resumed|finished|error" ; echo "rc=${PIPESTATUS[0]}"
  echo "--- resume on 1 GPU to step 1000"
  python3 -m gpuflow train --resume --name killrank --steps 1000 2>&1 | grep -E "resumed|finished|error"; echo "rc=${PIPESTATUS[0]}"
  python3 - "$run" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
bus = [r for r in rows if "h2d_bytes_per_step" in r]
print("logged steps:", rows[-1].get("step"), "report:", json.loads((run / "report.json").read_text())["steps_done"])
print("bus records (rank 0):", len(bus), "max h2d/step", max(r["h2d_bytes_per_step"] for r in bus),
      "max syncs/step", max(r["syncs_per_step"] for r in bus),
      "max cudaMalloc/step", max(r["device_allocs_per_step"] for r in bus))
PY
} >"$log" 2>&1
cat "$log"
