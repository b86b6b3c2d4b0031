"""Each train.allocator on CUDA: the command starts again under it, and the step then
allocates nothing from the device per steady step: captured under native and expandable;
eager under cudaMallocAsync, whose memory Triton cannot take during a capture."""

from __future__ import annotations

import json
import os

import pytest

from gpuflow.device.allocator import ENV, GENERIC_ENV
from tests.helpers import gpuflow_cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("allocator", ["native", "cudaMallocAsync", "expandable"])
def test_each_allocator_runs_the_captured_step_without_allocating(
    accel, prepared, workdir, allocator, monkeypatch
):
    if accel.type != "cuda":
        pytest.skip("the allocator backends are CUDA's")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(GENERIC_ENV, raising=False)
    sets = [f"data.dir={prepared}", f"train.allocator={allocator}"]
    done = gpuflow_cli(
        "bench", "train", "--preset", "tiny", "--modes", "resident,resident-graph", "--steps", "10",
        "--out", str(workdir / "out"), *(a for s in sets for a in ("--set", s)), cwd=workdir,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (result_file,) = (workdir / "out").glob("*-train-*.json")
    result = json.loads(result_file.read_text())
    assert result["allocator"] == allocator
    rows = {r["mode"]: r for r in result["rows"]}
    captured = allocator != "cudaMallocAsync"
    assert ("resident-graph" in rows) == captured
    if not captured:
        assert "cannot be captured under cudaMallocAsync" in result["skipped"]["resident-graph"]
    for mode in ("resident-graph",) if captured else ("resident",):
        assert rows[mode]["device_allocs_per_step"] == 0, mode
        assert rows[mode]["reserved_bytes"] > 0
    assert os.environ.get(ENV) is None  # the restart changed the child's environment only
