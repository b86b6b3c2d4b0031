"""``gpuflow bench soak`` on the cpu: a short run whose host memory is judged after warm-up,
and its table and plot."""

from __future__ import annotations

import tempfile

import pytest

from gpuflow.bench.soak import SERIES, SoakConfig, plot_soak, print_soak_table, run_soak
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from tests.helpers import FAST


def test_a_short_soak_judges_host_memory_flat_and_leaves_nothing(
    prepared, tmp_path, monkeypatch, capsys
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    sets = (*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=10")
    soak = SoakConfig(preset="tiny", steps=40, overrides=(*sets, "train.checkpoint_interval=10"))
    result = run_soak(Device("cpu"), soak)
    assert list(scratch.iterdir()) == []  # the run folder went with the scratch
    assert (result["steps"], result["warmup_steps"]) == (40, 12)
    # off CUDA only host memory is reported; its 64 MiB allowance holds for 40 steps
    assert set(result["verdicts"]) == {"rss_bytes"}
    verdict = result["verdicts"]["rss_bytes"]
    assert verdict["allowed"] == SERIES["rss_bytes"][1] and verdict["flat"] and result["flat"]
    assert [step for step, _ in result["samples"]["rss_bytes"]] == list(range(2, 41, 2))
    print_soak_table(result)
    assert "host resident memory" in capsys.readouterr().out
    plot = plot_soak(result, tmp_path / "soak.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_soak_that_ends_in_its_warm_up_is_refused_not_judged_flat(prepared):
    """Every series was skipped for want of samples, and no verdict read as all flat."""
    sets = (*FAST, f"data.dir={prepared}", "train.log_interval=5", "train.eval_interval=10")
    soak = SoakConfig(preset="tiny", steps=19, overrides=(*sets, "train.checkpoint_interval=10"))
    with pytest.raises(GpuflowError, match=r"19 steps end before two memory samples follow the "
                       r"warm-up \(to step 15.*give --steps 20 or more"):  # fmt: skip
        run_soak(Device("cpu"), soak)
