"""``gpuflow bench images`` on the cpu at the quick size: every feed timed, the baseline's
worker count the best it tried, the net's shapes, the host transforms' crops, and the CLI's
result file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gpuflow.bench.images import (
    PATHS,
    HostAugmented,
    ImagesBenchConfig,
    print_images_table,
    resnet_cifar,
    run_images_bench,
)
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from tests.helpers import child_env


@pytest.fixture(scope="module")
def quick():
    return run_images_bench(Device("cpu"), ImagesBenchConfig.quick())


def test_every_feed_is_timed_beside_the_baseline(quick, capsys):
    (row,) = quick["rows"]
    for path in PATHS:
        rates = row[f"{path}_images_s_per_round"]
        assert len(rates) == 1 and all(r > 0 for r in rates)
        assert row[f"{path}_images_s"] == rates[0]
    assert "resident_graph_images_s" not in row  # CUDA graphs only on CUDA
    assert "resident_uncompiled_images_s" not in row and not row["transform_compiled"]
    counted = row["resident_in_ledger_images_s"] / row["resident_images_s"]
    assert row["resident_in_ledger_vs_uncounted"] == pytest.approx(counted)
    tried = row["baseline_images_s_by_workers"]
    assert set(tried) == {"0", "1"}
    assert tried[str(row["baseline_workers"])] == max(tried.values())
    ratio = row["resident_images_s"] / row["dataloader_cpu_aug_images_s"]
    assert row["resident_vs_dataloader_cpu_aug"] == pytest.approx(ratio)
    assert row["dataset_device_bytes"] == 96 * 3 * 16 * 16 + 96  # uint8 images, uint8 labels
    assert row["ledger_resident"] == {"h2d_bytes_per_step": 0, "syncs_per_step": 0}
    assert row["peak_rss_bytes"] > 96 * 3 * 16 * 16  # the host images at least
    print_images_table(quick)
    out = capsys.readouterr().out
    assert "resident" in out and "of the data-free step" in out
    assert "inside a TransferLedger: resident at" in out


@pytest.mark.parametrize("side", [32, 64])
def test_the_net_classifies_both_sides_into_ten(side):
    logits = resnet_cifar(side, widths=(4, 8, 8, 8))(torch.zeros(2, 3, side, side))
    assert logits.shape == (2, 10)


def test_the_host_transforms_crop_from_the_reflected_image():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(4)
    data = HostAugmented(images, labels, augment=True)
    torch.manual_seed(0)
    for i in range(4):
        image, label = data[i]
        assert image.dtype == torch.uint8 and image.shape == (3, 8, 8) and label == i
        padded = F.pad(images[i][None].float(), (4, 4, 4, 4), mode="reflect")[0]
        windows = [
            padded[:, t : t + 8, left : left + 8].to(torch.uint8)
            for t in range(9)
            for left in range(9)
        ]
        assert any(torch.equal(image, w) or torch.equal(image, w.flip(-1)) for w in windows)
    assert torch.equal(HostAugmented(images, labels, augment=False)[2][0], images[2])


def test_settings_that_hold_no_batch_are_refused():
    with pytest.raises(GpuflowError, match="hold no batch"):
        ImagesBenchConfig(samples=10, batch_size=16)
    with pytest.raises(GpuflowError, match="multiples of 8"):
        ImagesBenchConfig(sides=(30,))


def test_the_cli_writes_its_result_file(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "bench", "images", "--quick", "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("*-images-quick-cpu.json")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "images" and len(record["rows"]) == 1
    assert record["config"]["batch_size"] == 16


def test_widths_that_are_not_four_channel_counts_are_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "bench", "images", "--widths", "16,32", "--device",
         "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --widths takes four positive channel counts, like 32,64,128,256; got '16,32'"
    ]
    assert list(tmp_path.iterdir()) == []


def test_sizes_given_with_quick_are_refused_not_ignored(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "bench", "images", "--quick", "--steps", "7",
         "--widths", "8,8,8,8", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --quick runs its own small sizes, so --steps and --widths would be ignored; "
        "drop them, or drop --quick"
    ]
    assert list(tmp_path.iterdir()) == []
