"""The example nets in examples/ learn their known solutions through the transfer layer,
and the library examples of the README and docs/ run as written.

XOR must round to the truth table, sine must fit a held-out grid and the image classifier
must label held-out images; batches must have crossed through a DeviceLoader, losses come
back through AsyncScalars, and on an accelerator each steady step must do 0 host syncs and
0 cudaMalloc calls.
"""

from __future__ import annotations

import importlib.util
import math
import re
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from gpuflow.accounting.budgets import BudgetExceeded
from gpuflow.device.accelerator import Device
from gpuflow.transfer.mirror import MirrorStats
from tests.helpers import DOCS, EXAMPLES, README, ROOT, child_env, plugin_args


def load_example(name: str) -> ModuleType:
    """Import examples/NAME.py by path (examples/ is a folder of scripts, not a package)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"gpuflow_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


xor = load_example("xor")
sine = load_example("sine")
images = load_example("images")
digits = load_example("digits")

XOR_STEPS, SINE_STEPS = 300, 600
IMAGES_STEPS, IMAGES_PER_EPOCH = 48, 16  # 3 epochs of 1024 images in batches of 64
WARMUP = 3  # steps each example runs before its budget applies (Config.warmup)
IMAGES_WARMUP = IMAGES_PER_EPOCH + 1  # images.py's: the first epoch and a step
XOR_BATCH_BYTES = 4 * 2 * 4 + 4 * 1 * 4  # x (4, 2) and y (4, 1) float32, one buffer
SINE_BATCH_BYTES = 2 * 128 * 4  # x and y, (128, 1) float32 each
IMAGE_BYTES = 3 * 32 * 32  # one uint8 image
IMAGES_BATCH_BYTES = 64 * IMAGE_BYTES + 64 * 8  # as the DataLoader collated them
IMAGES_LOGICAL_BYTES = IMAGES_BATCH_BYTES


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These nets are too small to gain from intra-op threads, and on a busy 2-core machine
    OpenMP's waiting threads made the sine run 10x slower (25 s instead of 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def xor_cpu():
    return xor.train("cpu", XOR_STEPS, seed=0)


@pytest.fixture(scope="module")
def sine_cpu():
    return sine.train("cpu", SINE_STEPS, seed=0)


@pytest.fixture(scope="module")
def digits_cpu():
    return digits.train("cpu", epochs=12, seed=0)


@pytest.fixture(scope="module")
def images_cpu():
    return images.train("cpu", IMAGES_STEPS, seed=0, workers=2)


def interval_means(result) -> list[float]:
    return [means["loss"] for _, means in result.losses]


# ---- the known solutions ----------------------------------------------------------------------


def test_xor_rounds_to_the_truth_table(xor_cpu):
    assert xor_cpu.device == "cpu"
    assert np.round(xor_cpu.predictions).tolist() == [0, 1, 1, 0]
    assert xor_cpu.solved
    assert xor_cpu.final_loss < 0.01


def test_sine_fits_points_it_never_saw(sine_cpu):
    assert sine_cpu.grid.shape == sine_cpu.predictions.shape == (201,)
    assert (sine_cpu.grid[0], sine_cpu.grid[-1]) == pytest.approx((-math.pi, math.pi))
    assert sine_cpu.final_loss < 1e-3
    assert np.max(np.abs(sine_cpu.predictions - np.sin(sine_cpu.grid))) < 0.1


def test_images_classifies_images_it_never_saw(images_cpu):
    assert images_cpu.device == "cpu"
    assert images_cpu.epochs == IMAGES_STEPS // IMAGES_PER_EPOCH == 3
    assert images_cpu.accuracy > 0.95  # chance is 0.1
    final = images_cpu.losses[-1][1]
    assert final["loss"] < 0.05 and final["accuracy"] > 0.95  # the last 8 training batches


def test_digits_classifies_held_out_scans_from_a_resident_dataset(digits_cpu):
    assert digits_cpu.test_accuracy > 0.95  # 360 held-out scans; chance is 0.1
    assert len(digits_cpu.losses) == 12
    assert digits_cpu.losses[-1] < digits_cpu.losses[0] / 10
    assert digits_cpu.stored == ("uint8", "uint8")  # pixels 0-16 and labels 0-9, narrowed
    # Every step after the first drew its batch on the device: nothing crossed, no wait.
    assert (digits_cpu.h2d_bytes_per_step, digits_cpu.syncs_per_step) == (0, 0)


@pytest.mark.gpu
def test_digits_on_the_accelerator(accel):
    pytest.importorskip("sklearn")  # the digits ship with scikit-learn
    result = digits.train(accel, epochs=12, seed=0)
    assert result.test_accuracy > 0.95
    assert (result.h2d_bytes_per_step, result.syncs_per_step) == (0, 0)


# ---- how the numbers travelled ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "steps", "every"),
    [("xor_cpu", XOR_STEPS, 25), ("sine_cpu", SINE_STEPS, 50), ("images_cpu", IMAGES_STEPS, 8)],
)
def test_losses_came_back_through_async_scalars(request, name, steps, every):
    result = request.getfixturevalue(name)
    assert [tag for tag, _ in result.losses] == list(range(every, steps + 1, every))
    means = interval_means(result)
    assert means[-1] < means[0] / 100  # learning, as seen by the host a flush late
    assert min(means[: len(means) // 2]) > min(means[len(means) // 2 :])


def test_each_flushed_loss_is_the_mean_of_its_interval(monkeypatch):
    seen: list[float] = []
    step = xor.train_step_no_sync

    def spying_step(*args):
        loss = step(*args)
        # the spy's own read: .numpy() of a cpu tensor, which the ledger leaves to the spy
        # (float(loss) would count as a read that waits on a GPU, and fail the budget)
        seen.append(float(loss.detach().numpy()))
        return loss

    monkeypatch.setattr(xor, "train_step_no_sync", spying_step)
    result = xor.train("cpu", 60, seed=0)
    assert [tag for tag, _ in result.losses] == [25, 50, 60]  # drain flushed the last 10
    expected = [np.mean(seen[0:25]), np.mean(seen[25:50]), np.mean(seen[50:60])]
    assert interval_means(result) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("name", "steps", "nbytes"),
    [("xor_cpu", XOR_STEPS, XOR_BATCH_BYTES), ("sine_cpu", SINE_STEPS, SINE_BATCH_BYTES)],
)
def test_every_batch_crossed_through_a_device_loader(request, name, steps, nbytes):
    result = request.getfixturevalue(name)
    stats = result.loader
    assert stats.batches == steps
    assert stats.copies <= steps // 16  # small batches share their copies
    assert stats.bytes_moved == stats.logical_bytes == steps * nbytes  # floats cross as they are
    # The loader reports each batch to the ledger open on the step that takes it.
    assert len(result.steady_steps) == steps - WARMUP
    assert {(t.h2d_bytes, t.h2d_copies) for t in result.steady_steps} == {(nbytes, 1)}
    assert all(t.syncs == 0 for t in result.steady_steps)


def test_image_batches_crossed_from_the_dataloader_as_uint8(images_cpu):
    stats = images_cpu.loader
    assert stats.batches == IMAGES_STEPS
    assert stats.copies < IMAGES_STEPS  # batches under 256 KiB share their copies
    assert stats.logical_bytes == IMAGES_STEPS * IMAGES_LOGICAL_BYTES
    assert stats.bytes_moved == IMAGES_STEPS * IMAGES_BATCH_BYTES  # uint8 images as they are
    # The step that opens the third epoch counts like the rest: one batch, nothing else.
    assert images.Config().warmup == IMAGES_WARMUP
    assert len(images_cpu.steady_steps) == IMAGES_STEPS - IMAGES_WARMUP
    assert {(t.h2d_bytes, t.h2d_copies) for t in images_cpu.steady_steps} == {
        (IMAGES_BATCH_BYTES, 1)
    }
    assert all(t.syncs == 0 for t in images_cpu.steady_steps)


def test_the_classifier_weights_came_back_through_a_host_mirror(images_cpu):
    assert images_cpu.head_weights.shape == (10, 32)
    assert images_cpu.mirror == MirrorStats(hits=0, misses=1, bytes_fetched=10 * 32 * 4)
    torch.manual_seed(0)
    untrained = images.make_model(10)[-1].weight.detach().numpy()  # the run's starting weights
    assert not np.allclose(images_cpu.head_weights, untrained, atol=1e-3)


def test_images_workers_do_not_change_the_run(images_cpu):
    in_process = images.train("cpu", IMAGES_STEPS, seed=0, workers=0)
    assert in_process.losses == images_cpu.losses
    assert np.array_equal(in_process.head_weights, images_cpu.head_weights)
    assert in_process.accuracy == images_cpu.accuracy
    assert in_process.loader.bytes_moved == images_cpu.loader.bytes_moved


def test_the_budget_catches_a_host_wait_in_the_step(monkeypatch):
    calls = []
    step = xor.train_step_no_sync

    def waiting_step(*args):
        calls.append(1)
        Device("cpu").synchronize()  # a host wait: counted on the cpu too
        return step(*args)

    monkeypatch.setattr(xor, "train_step_no_sync", waiting_step)
    with pytest.raises(BudgetExceeded) as caught:
        xor.train("cpu", 20, seed=0)
    assert caught.value.over == {"syncs": (1, 0)}
    assert len(calls) == WARMUP + 1  # the warm-up steps are not budgeted
    assert "test_examples.py" in str(caught.value)


# ---- runs, seeds and arguments ----------------------------------------------------------------


def test_a_seed_fixes_the_run():
    first, again, other = (xor.train("cpu", 40, seed=s) for s in (1, 1, 2))
    assert np.array_equal(first.predictions, again.predictions)
    assert first.losses == again.losses
    assert not np.array_equal(first.predictions, other.predictions)


def test_impossible_settings_are_refused():
    with pytest.raises(ValueError, match="warm-up"):
        xor.train("cpu", steps=3)
    with pytest.raises(ValueError, match="hidden"):
        xor.Config(hidden=1)
    with pytest.raises(ValueError, match="batch_size"):
        sine.Config(batch_size=4096)
    with pytest.raises(ValueError, match="batch_size"):
        images.Config(batch_size=2048)
    with pytest.raises(ValueError, match="classes"):
        images.Config(classes=1)
    with pytest.raises(ValueError, match="17 warm-up"):
        images.train("cpu", steps=17, workers=0)


def test_xor_runs_as_a_script(monkeypatch, capsys):
    script = EXAMPLES / "xor.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--steps", "150"])
    runpy.run_path(str(script), run_name="__main__")  # as `python examples/xor.py` would
    out = capsys.readouterr().out
    assert out.startswith("xor on cpu: 150 steps")
    assert "solved: yes" in out
    assert "147 budgeted steps: [48] B host->device each, 0 syncs" in out


def test_images_runs_as_a_script(monkeypatch, capsys):
    script = EXAMPLES / "images.py"
    argv = [str(script), "--device", "cpu", "--steps", "20", "--workers", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(script), run_name="__main__")  # as `python examples/images.py` would
    out = capsys.readouterr().out
    assert out.startswith("images on cpu: 20 steps (2 epochs, num_workers=1)")  # 16 + 4
    assert "step    16  loss" in out and "step    20  loss" in out
    assert "held-out accuracy" in out
    assert "(10, 32) read through a HostMirror: 1,280 B fetched" in out
    assert f"3 budgeted steps: [{IMAGES_BATCH_BYTES}] B host->device each, 0 syncs" in out


def test_sine_main_prints_its_fit(capsys):
    result = sine.main(["--device", "cpu", "--steps", "100", "--seed", "3"])
    out = capsys.readouterr().out
    assert out.startswith("sine on cpu: 100 steps")
    assert f"held-out MSE {result.final_loss:.2e} on 201 points" in out
    assert "step    50  loss" in out and "step   100  loss" in out


# ---- on an accelerator: the same solutions, and steady steps that never wait ------------------


def assert_steady_steps_held(
    result, steps: int, every: int, nbytes: int, scalars: int = 1, warmup: int = WARMUP
) -> None:
    """Every budgeted step moved one batch up, waited for nothing and allocated nothing;
    the only downloads were the sums of the flush steps (one float64 per scalar)."""
    assert len(result.steady_steps) == steps - warmup
    for step, totals in enumerate(result.steady_steps, start=warmup):
        assert (totals.syncs, totals.device_allocs) == (0, 0), (step, totals)
        assert (totals.h2d_bytes, totals.h2d_copies) == (nbytes, 1), (step, totals)
        flushed = (step + 1) % every == 0
        assert totals.d2h_bytes == (8 * scalars if flushed else 0), (step, totals)


@pytest.mark.gpu
def test_xor_on_the_accelerator(accel):
    result = xor.train(accel, XOR_STEPS, seed=0)
    assert result.device.startswith(accel.type)
    assert np.round(result.predictions).tolist() == [0, 1, 1, 0]
    assert result.final_loss < 0.01
    assert [tag for tag, _ in result.losses] == list(range(25, XOR_STEPS + 1, 25))
    assert_steady_steps_held(result, XOR_STEPS, 25, XOR_BATCH_BYTES)


@pytest.mark.gpu
def test_sine_on_the_accelerator(accel):
    result = sine.train(accel, SINE_STEPS, seed=0)
    assert result.final_loss < 1e-3
    means = interval_means(result)
    assert [tag for tag, _ in result.losses] == list(range(50, SINE_STEPS + 1, 50))
    assert means[-1] < means[0] / 100
    assert result.loader.batches == SINE_STEPS
    assert_steady_steps_held(result, SINE_STEPS, 50, SINE_BATCH_BYTES)


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [2, 0])
def test_images_on_the_accelerator(accel, workers):
    result = images.train(accel, IMAGES_STEPS, seed=0, workers=workers)
    assert result.device.startswith(accel.type)
    assert result.accuracy > 0.95
    assert [tag for tag, _ in result.losses] == list(range(8, IMAGES_STEPS + 1, 8))
    assert result.mirror.bytes_fetched == 10 * 32 * 4
    # Step 32 starts the third epoch inside the budget: a new pass allocates nothing.
    assert_steady_steps_held(
        result, IMAGES_STEPS, 8, IMAGES_BATCH_BYTES, scalars=2, warmup=IMAGES_WARMUP
    )


@pytest.mark.gpu
def test_a_stray_item_in_the_example_step_is_caught_on_the_accelerator(accel, monkeypatch):
    step = xor.train_step_no_sync

    def logging_step(*args):
        loss = step(*args)
        print(f"loss {loss.item():.4f}")  # the stray read
        return loss

    monkeypatch.setattr(xor, "train_step_no_sync", logging_step)
    with pytest.raises(BudgetExceeded) as caught:
        xor.train(accel, 20, seed=0)
    assert caught.value.over == {"syncs": (1, 0)}
    line = next(
        n
        for n, text in enumerate(Path(__file__).read_text().splitlines(), start=1)
        if text.endswith("# the stray read")
    )
    assert f"test_examples.py:{line}" in str(caught.value)


def test_the_budget_tests_example_passes_under_pytest(tmp_path):
    import subprocess
    import sys

    # The plugin registers itself where gpuflow is installed (pip install -e .); where gpuflow
    # is only on the path, plugin_args names it.
    example = EXAMPLES / "test_transfer_budgets.py"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *plugin_args(),
            str(example),
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


# ---- the documented library examples, each run as written where it stands ----------------

# A marker line, then the Python block it marks.
MARKED_EXAMPLE = re.compile(r"<!-- (library-example[\w-]*) -->\n```python\n(.*?)```", re.DOTALL)
# Each marked block and the page it stands in, relative to the repository.
DOCUMENTED_EXAMPLES = {
    "library-example": "README.md",
    "library-example-pack": "docs/library.md",
    "library-example-ledger": "docs/accounting.md",
    "library-example-resident": "README.md",
}


def documented_examples() -> dict[tuple[str, str], str]:
    """The code of each marked block in the README and the pages under docs/, by (marker,
    page), with as many blank lines before it as the page has: its line numbers are the
    page's."""
    found = {}
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text, name = page.read_text(), page.relative_to(ROOT).as_posix()
        for match in MARKED_EXAMPLE.finditer(text):
            assert (match[1], name) not in found, f"{match[1]} twice in {name}"
            found[match[1], name] = "\n" * text.count("\n", 0, match.start(2)) + match[2]
    return found


def example_code(marker: str) -> str:
    return documented_examples()[marker, DOCUMENTED_EXAMPLES[marker]]


def run_documented_example(marker: str, capsys) -> str:
    """Run one marked block as a reader would paste it, named by its page; what it printed."""
    exec(compile(example_code(marker), DOCUMENTED_EXAMPLES[marker], "exec"), {})
    return capsys.readouterr().out


def test_every_marked_example_is_run_here():
    assert sorted(documented_examples()) == sorted(DOCUMENTED_EXAMPLES.items())  # on its page


def test_the_readmes_library_example_runs_as_written(capsys):
    out = run_documented_example("library-example", capsys)
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "loss" in line]
    assert len(losses) == 4  # 2 epochs x 2 flushes (on a cpu, drain finds nothing left)
    assert losses[-1] < losses[0]
    assert "weights, row 0:" in out


def test_the_pack_example_runs_as_written(capsys):
    out = run_documented_example("library-example-pack", capsys)
    assert "18,496 B as given, 6,208 B copied" in out  # ids narrowed from 8 bytes to 2
    shapes = "{'ids': (torch.int64, (16, 128)), 'mask': (torch.bool, (16, 128)), "
    assert shapes + "'weights': (torch.float32, (16,))}" in out


def test_the_ledger_example_runs_as_written(capsys):
    out = run_documented_example("library-example-ledger", capsys)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps == [f"step {n}: 1,040 B in 1 copy, 0 syncs" for n in range(3)]
    assert "transfer budget exceeded:\n  syncs: 1 > 0" in out
    page = DOCUMENTED_EXAMPLES["library-example-ledger"]
    lines = (ROOT / page).read_text().splitlines()
    wait = next(n for n, line in enumerate(lines, 1) if "device.synchronize()  #" in line)
    assert f"Device.synchronize  at {page}:{wait}" in out  # the budget names the page's line


def test_the_resident_example_runs_as_written(capsys):
    out = run_documented_example("library-example-resident", capsys)
    accuracy = float(out.split("held-out accuracy: ")[1].split(";")[0])
    assert accuracy > 0.95  # 297 held-out scans; chance is 0.1
    assert "stored as ['torch.uint8', 'torch.uint8']" in out
