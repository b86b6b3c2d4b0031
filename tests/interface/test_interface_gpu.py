"""What a user runs on the accelerator: sampling a trained run, and the profile command."""

from __future__ import annotations

import hashlib
import json

import pytest

from gpuflow.interface.profile import profile_training
from gpuflow.interface.sample import SampleConfig, sample
from gpuflow.train.config import resolve_config
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

pytestmark = pytest.mark.gpu


def test_sample_on_the_accelerator(accel, prepared, workdir):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", "train.steps=5"])
    Trainer(config, workdir / "runs" / "s", accel).run()
    text = sample(workdir / "runs" / "s", SampleConfig(prompt="Return", max_tokens=20), accel)
    assert text.startswith("Return")


def test_profile_command_writes_a_trace_and_its_copies_agree(accel, prepared, workdir):
    config = resolve_config(
        "tiny", None, [*FAST, f"data.dir={prepared}", "train.data_path=streamed"]
    )
    out = workdir / "profile"
    result = profile_training(config, out, accel, steps=4, warmup=2)
    for name in ("trace.json", "timeline.png", "profile.json"):
        assert (out / name).stat().st_size > 0
    rows = {row["kind"]: row for row in result["crosscheck"]}
    assert rows["h2d"]["agrees"] and rows["h2d"]["ledger_copies"] == 4, rows
    m = result["metrics"]
    assert m["syncs_per_batch"] == 0 and m["device_allocs_per_batch"] == 0
    assert 0 < m["link_utilisation"] <= 1.2 and 0 <= m["transfer_overhead"] <= 1
    assert json.loads((out / "profile.json").read_text())["steps"] == 4


def test_profile_of_the_captured_step_shows_no_transfers(accel, prepared, workdir):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}"])
    result = profile_training(config, workdir / "profile-graph", accel, steps=4, warmup=4)
    assert result["data_path"] == "resident-graph"
    rows = {row["kind"]: row for row in result["crosscheck"]}
    assert rows["h2d"]["ledger_copies"] == rows["h2d"]["profiler_copies"] == 0  # uploaded before
    m = result["metrics"]
    assert m["h2d_bytes_per_batch"] == 0 and m["syncs_per_batch"] == 0 and m["step_ms"] > 0


def test_profile_on_the_accelerator_takes_its_own_folder_again(accel, prepared, workdir):
    """Its timeline is vouched for in profile.json like its trace, so the folder is reused."""
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}"])
    out = workdir / "again"
    first = profile_training(config, out, accel, steps=1, warmup=1)
    assert set(first["files"]) == {"trace.json", "timeline.png"}
    second = profile_training(config, out, accel, steps=1, warmup=1)
    assert sorted(p.name for p in out.iterdir()) == ["profile.json", "timeline.png", "trace.json"]
    png = hashlib.sha256((out / "timeline.png").read_bytes()).hexdigest()
    assert second["files"]["timeline.png"] == f"sha256:{png}"
