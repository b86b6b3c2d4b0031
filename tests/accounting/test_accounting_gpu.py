"""The transfer ledger and budgets on a real device: against the profiler's record, over
the production streamed step, and at every kind of host wait."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.data.resident.sources import StreamedBatches
from gpuflow.train.config import resolve_config
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

pytestmark = pytest.mark.gpu


def test_ledger_agrees_with_the_profilers_memcpy_events(accel, tmp_path):
    from gpuflow.accounting.crosscheck import ProfiledLedger

    pinned = torch.randn(1 << 18).pin_memory()  # 1 MiB
    pageable = torch.randn(1024)  # 4 KiB
    on_device = torch.randn(1 << 14, device=accel.torch)  # 64 KiB
    landing = torch.empty(1 << 14).pin_memory()
    accel.synchronize()
    with ProfiledLedger(tmp_path / "trace.json", accel) as run:
        pinned.to(accel.torch, non_blocking=True)
        pageable.to(accel.torch)  # blocking: a sync
        landing.copy_(on_device, non_blocking=True)
        for i in range(3):
            on_device[i].item()  # 4 bytes down and a sync, each
    rows = {row.kind: row for row in run.comparison()}
    assert (rows["h2d"].ledger_copies, rows["h2d"].ledger_bytes) == (2, (1 << 20) + 4096)
    assert (rows["d2h"].ledger_copies, rows["d2h"].ledger_bytes) == (4, (1 << 16) + 12)
    assert rows["h2d"].agrees and rows["d2h"].agrees, rows
    assert run.ledger.summary().totals.syncs == 4
    assert (tmp_path / "trace.json").stat().st_size > 0


def _streaming_trainer(accel, prepared, workdir):
    """A built trainer on the streamed path, and the token ids one of its batches holds."""
    config = resolve_config(
        "tiny",
        None,
        [*FAST, f"data.dir={prepared}", "train.steps=12", "train.data_path=streamed"],
    )
    trainer = Trainer(config, workdir / "runs" / "budget", accel)
    trainer.build(resume=False)
    return trainer, config.train.batch_size * (config.model.max_len + 1)


def test_streamed_step_budget_holds_on_the_device(accel, prepared, workdir):
    trainer, ids = _streaming_trainer(accel, prepared, workdir)
    with trainer.open_step(0, 12) as train_step:  # the step `gpuflow train` runs
        assert isinstance(train_step.batches, StreamedBatches)
        for step in range(3):  # warm-up: the allocator fills its cache
            train_step(step)
        accel.synchronize()
        for step in range(3, 8):
            limits = budget(
                h2d_bytes=(2 * ids + 15) // 16 * 16, d2h_bytes=0, syncs=0, device_allocs=0
            )
            with limits:
                train_step(step)
            totals = limits.ledger.summary().totals
            assert totals.h2d_bytes == 2 * ids and totals.h2d_copies == 1


def test_a_stray_item_in_a_training_step_is_caught_at_its_line(accel, prepared, workdir):
    trainer, _ = _streaming_trainer(accel, prepared, workdir)
    with trainer.open_step(0, 12) as train_step:

        def leaky_step(step):
            train_step(step)
            print(f"loss {train_step.last_loss.item():.3f}")  # the stray read

        train_step(0)
        with pytest.raises(BudgetExceeded) as caught, budget(syncs=0):
            leaky_step(1)
    line = next(
        n
        for n, text in enumerate(Path(__file__).read_text().splitlines(), start=1)
        if "# the stray read" in text and "text" not in text
    )
    assert f"{Path(__file__).name}:{line}" in str(caught.value)
    assert caught.value.over == {"syncs": (1, 0)}


def test_every_kind_of_host_wait_is_counted_on_the_device(accel):
    from gpuflow.accounting.ledger import TransferLedger

    x = torch.arange(8, device=accel.torch, dtype=torch.float32)
    stream, event = torch.cuda.Stream(), torch.cuda.Event()
    with TransferLedger(accel) as ledger:
        x.tolist()  # wait-tolist
        x.cpu()  # wait-cpu
        x.nonzero()
        x[x > 3]
        event.record()
        event.synchronize()
        stream.synchronize()
        torch.cuda.synchronize()
        accel.synchronize()
        x.sum()  # compute: nothing counted
    syncs = [e for e in ledger.events if e.kind == "sync"]
    lines = Path(__file__).read_text().splitlines()

    def at(marker: str) -> list[str]:
        line = next(n for n, t in enumerate(lines, 1) if marker in t and "at(" not in t)
        return [e.op for e in syncs if e.location.endswith(f":{line}")]

    assert at("# wait-tolist") and at("# wait-cpu") == ["blocking d2h to"]
    assert [e.op for e in syncs][-6:] == [
        "nonzero",
        "boolean-mask indexing",
        "Event.synchronize",
        "Stream.synchronize",
        "torch.cuda.synchronize",
        "Device.synchronize",
    ]
    downloads = [e for e in ledger.events if e.kind == "d2h"]
    assert sum(e.nbytes for e in downloads) >= 2 * 32  # tolist and cpu: 32 bytes each


def test_an_item_in_a_gradient_hook_is_counted_at_its_line(accel):
    """The backward of device tensors runs on autograd's device thread, hooks included."""
    from gpuflow.accounting.ledger import TransferLedger

    weight = torch.ones(8, device=accel.torch, requires_grad=True)
    norms: list[float] = []

    def hook(grad: torch.Tensor) -> None:
        norms.append(grad.norm().item())  # hook-item
        torch.cuda.synchronize()  # hook-wait

    weight.register_hook(hook)
    with TransferLedger(accel) as ledger:
        (weight * 3).sum().backward()
    lines = Path(__file__).read_text().splitlines()
    item_line = next(n for n, t in enumerate(lines, 1) if "# hook-item" in t and "next(" not in t)
    wait_line = next(n for n, t in enumerate(lines, 1) if "# hook-wait" in t and "next(" not in t)
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [e.op for e in syncs] == ["blocking d2h item", "torch.cuda.synchronize"], syncs
    assert syncs[0].location.endswith(f"{Path(__file__).name}:{item_line}")
    assert syncs[1].location.endswith(f"{Path(__file__).name}:{wait_line}")
    assert norms == [pytest.approx(3 * 8**0.5)]


def test_backwards_of_two_threads_count_in_their_own_ledgers(accel):
    """Autograd's device thread serves both threads' backwards: each hook's read counts in
    the ledger of the thread whose backward ran it, and a backward run outside any ledger
    while one is open elsewhere counts nowhere."""
    import threading

    from gpuflow.accounting.ledger import TransferLedger

    downloads: dict[str, int] = {}
    start = threading.Barrier(3)

    def train(name: str, reads: int, counted: bool) -> None:
        weight = torch.ones(8, device=accel.torch, requires_grad=True)
        weight.register_hook(lambda grad: [grad.sum().item() for _ in range(reads)] and None)
        start.wait()
        for _ in range(5):
            if not counted:
                (weight * 2).sum().backward()
                continue
            with TransferLedger(accel) as ledger:
                (weight * 2).sum().backward()
            found = sum(e.kind == "d2h" for e in ledger.events)
            downloads[name] = downloads.get(name, 0) + found

    threads = [
        threading.Thread(target=train, args=("one", 1, True)),
        threading.Thread(target=train, args=("two", 2, True)),
        threading.Thread(target=train, args=("none", 3, False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert downloads == {"one": 1 * 5, "two": 2 * 5}


def test_printing_a_device_tensor_is_a_counted_wait(accel, capsys):
    from gpuflow.accounting.ledger import TransferLedger

    x = torch.arange(4, device=accel.torch)
    with pytest.raises(BudgetExceeded, match="print of a device tensor"), budget(syncs=0):
        print(x)
    with TransferLedger(accel) as ledger:
        print(f"{x}")
    assert [e.op for e in ledger.events if e.kind == "sync"] == ["print of a device tensor"]
    assert "tensor([0, 1, 2, 3]" in capsys.readouterr().out


def test_a_compiled_step_runs_compiled_under_a_budget_and_after_it(accel):
    """Inductor, on the device: the compiled step is neither run eagerly nor recompiled by
    the budget around it, and its upload is still counted."""
    import torch._dynamo.utils as dynamo_utils

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to(accel.torch)
    host = torch.randn(32, 64).pin_memory()

    @torch.compile
    def step(batch: torch.Tensor) -> torch.Tensor:
        return model(batch.to(accel.torch, non_blocking=True)).square().mean()

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    with budget(syncs=0, d2h_bytes=0) as limited:
        step(host)  # the first call compiles, under the budget
    compiled = dynamo_utils.counters["stats"]["unique_graphs"]
    assert compiled >= 1
    assert limited.summary().totals.h2d_bytes == host.numel() * 4
    for _ in range(3):
        with budget(syncs=0, d2h_bytes=0):
            step(host)
        step(host)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == compiled  # no recompiles
    assert not dynamo_utils.counters["recompiles"]


def test_a_tensor_made_on_the_device_from_host_data_is_a_counted_blocking_copy(accel):
    import numpy as np

    from gpuflow.accounting.ledger import TransferLedger

    with TransferLedger(accel) as ledger:
        torch.tensor([1.0, 2.0, 3.0], device=accel.torch)  # from-list
        torch.as_tensor(np.arange(6, dtype=np.int64), device=accel.torch)  # from-array
        torch.tensor([1, 2])  # on the host: nothing crosses
    copies = [e for e in ledger.events if e.kind == "h2d"]
    assert [(e.nbytes, e.blocking) for e in copies] == [(12, True), (48, True)], copies
    lines = Path(__file__).read_text().splitlines()
    for marker, event in zip(("# from-list", "# from-array"), copies, strict=True):
        line = next(n for n, t in enumerate(lines, 1) if marker in t and "zip(" not in t)
        assert event.location.endswith(f"{Path(__file__).name}:{line}")
    assert sum(e.kind == "sync" for e in ledger.events) == 2


def test_an_item_inside_a_compiled_function_is_counted_on_the_device(accel):
    """Inductor, on the device: the `.item()` at the graph break runs between two compiled
    graphs and is counted at its line, as it is outside torch.compile."""
    if accel.type != "cuda":
        pytest.skip("inductor's device code: cuda")
    import torch._dynamo.utils as dynamo_utils

    from gpuflow.accounting.ledger import TransferLedger

    @torch.compile
    def step(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # compiled-device-item
        return (x / scale).square().sum()

    x = torch.randn(64, device=accel.torch)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    step(x)
    compiled = dynamo_utils.counters["stats"]["unique_graphs"]
    assert compiled >= 1
    with TransferLedger(accel) as ledger:
        step(x)
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [e.op for e in syncs] == ["blocking d2h item"], ledger.events
    line = next(
        n
        for n, text in enumerate(Path(__file__).read_text().splitlines(), start=1)
        if "# compiled-device-item" in text and "text" not in text
    )
    assert syncs[0].location.endswith(f"{Path(__file__).name}:{line}")
    assert [(e.kind, e.nbytes) for e in ledger.events if e.kind == "d2h"] == [("d2h", 4)]
    with pytest.raises(BudgetExceeded, match="blocking d2h item"), budget(syncs=0):
        step(x)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == compiled  # the same graphs ran
    assert not dynamo_utils.counters["recompiles"]


def test_a_budget_for_the_gpu_counts_device_reads_and_leaves_host_reads_alone(accel):
    """On a machine with a GPU, "auto" is the GPU: a read of a host tensor waits for nothing
    there and is not counted; the same read of a device tensor is."""
    scores = torch.arange(4.0)  # on the host
    with budget(syncs=0) as ledger:
        scores.sum().item()
    assert ledger.events == []
    with pytest.raises(BudgetExceeded, match="item"), budget(syncs=0):
        scores.to(accel.torch).sum().item()
