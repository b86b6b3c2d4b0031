"""The transfer ledger on the cpu: copies, syncs, locations, steps, nesting, budgets, metrics.

Meta tensors stand in for device tensors: copies to them go through the same dispatch
path and are counted like real ones, so the accounting runs without an accelerator.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gpuflow
from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.accounting.crosscheck import Interval, device_activity
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.accounting.metrics import from_activity, intersection, merged
from gpuflow.data.resident.sources import StreamedBatches
from gpuflow.device.accelerator import Device, HostEvent
from gpuflow.train.config import resolve_config
from gpuflow.train.trainer import Trainer
from gpuflow.transfer.loader import DeviceLoader
from tests.helpers import FAST, line_holding, plugin_args

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


def _meta_raises(fn) -> None:
    """Ops that read device data cannot run on meta tensors; the ledger sees them first."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        fn()


def test_copies_are_counted_with_bytes_type_memory_and_location():
    host = torch.arange(1000, dtype=torch.float32)
    target = torch.empty(10, dtype=torch.int64, device="meta")
    with TransferLedger("cpu") as ledger:
        host.to("meta")  # copy-a
        target.copy_(torch.zeros(10, dtype=torch.int64), non_blocking=True)  # copy-b
        host.add(1)  # compute on the host: not a transfer
    copies = [e for e in ledger.events if e.kind != "sync"]
    assert [(e.kind, e.nbytes, e.dtype, e.pinned, e.blocking) for e in copies] == [
        ("h2d", 4000, "float32", False, True),
        ("h2d", 80, "int64", False, False),
    ]
    assert copies[0].location.endswith(f"{HERE}:{_line('# copy-a')}")
    assert copies[1].location.endswith(f"{HERE}:{_line('# copy-b')}")
    # The blocking copy made the host wait; the non_blocking one did not.
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [s.op for s in syncs] == ["blocking h2d to"]
    totals = ledger.summary().totals
    assert (totals.h2d_bytes, totals.h2d_copies, totals.syncs) == (4080, 2, 1)


def test_reads_of_device_data_count_as_syncs_where_they_are_written():
    x = torch.ones(4, device="meta")
    with TransferLedger("cpu") as ledger:
        _meta_raises(lambda: x.sum().item())  # sync-item
        _meta_raises(lambda: x.nonzero())  # sync-nonzero
        _meta_raises(lambda: x[x > 0])  # sync-mask
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [s.op for s in syncs] == ["blocking d2h item", "nonzero", "boolean-mask indexing"]
    for event, marker in zip(syncs, ("# sync-item", "# sync-nonzero", "# sync-mask"), strict=True):
        assert event.location.endswith(f"{HERE}:{_line(marker)}")
    item = next(e for e in ledger.events if e.kind == "d2h")
    assert (item.nbytes, item.dtype, item.blocking) == (4, "float32", True)


def test_explicit_waits_count_once_each():
    cpu = Device("cpu")
    event = cpu.new_event()
    with TransferLedger("cpu") as ledger:
        event.record()
        event.query()  # asks, does not wait: not a sync
        event.synchronize()
        cpu.synchronize()
    assert [e.op for e in ledger.events] == ["Event.synchronize", "Device.synchronize"]


def test_steps_give_per_step_totals_medians_and_top_locations():
    x = torch.ones(256)  # 1 KiB of float32
    with TransferLedger("cpu") as ledger:
        for step in range(4):
            for _ in range(step + 1):
                x.to("meta", non_blocking=True)  # per-step
            ledger.step()
        x.to("meta")  # extra
    summary = ledger.summary()
    assert [s.h2d_bytes for s in summary.steps] == [1024, 2048, 3072, 4096, 1024]
    assert summary.median("h2d_bytes") == 2048
    assert summary.totals.h2d_bytes == 11 * 1024
    (where, nbytes), *_ = summary.top_by_bytes
    assert where.endswith(f"{HERE}:{_line('# per-step')}") and nbytes == 10 * 1024
    [(where, syncs)] = summary.top_by_syncs
    assert where.endswith(f"{HERE}:{_line('# extra')}") and syncs == 1
    assert "h2d_bytes" in summary.table() and "steps: 5" in summary.table()


def test_ledgers_nest_and_leave_nothing_behind():
    x = torch.ones(10)
    original_wait = HostEvent.synchronize
    with TransferLedger("cpu") as outer:
        x.to("meta", non_blocking=True)
        with TransferLedger("cpu") as inner:
            x.to("meta", non_blocking=True)
            Device("cpu").new_event().synchronize()
        x.to("meta", non_blocking=True)
    assert outer.summary().totals.h2d_copies == 3 and outer.summary().totals.syncs == 1
    assert inner.summary().totals.h2d_copies == 1 and inner.summary().totals.syncs == 1
    # Closed: no dispatch mode, the waits are torch's and gpuflow's own again, nothing counts.
    assert _get_current_dispatch_mode() is None
    assert HostEvent.synchronize is original_wait
    x.to("meta")
    assert outer.summary().totals.h2d_copies == 3


def test_other_threads_are_not_counted_but_loader_batches_are():
    x = torch.ones(10)
    batches = [np.full((4, 9), i, dtype=np.int64) for i in range(3)]
    with TransferLedger("cpu") as ledger, DeviceLoader(iter(batches), "cpu") as loader:
        worker = threading.Thread(target=lambda: x.to("meta"))
        worker.start()
        worker.join()
        for batch in loader:  # loader-line
            assert batch.dtype == torch.int64
    # (The loader's close() at the end of the loop waits for its copies: syncs, not copies.)
    events = [e for e in ledger.events if e.kind != "sync"]
    assert [e.op for e in events] == ["DeviceLoader batch"] * 3
    # 4 x 9 int64 each, at the consuming line.
    assert {e.nbytes for e in events} == {288}
    assert all(e.location.endswith(f"{HERE}:{_line('# loader-line')}") for e in events)


def test_budget_passes_within_limits_and_lists_each_offender():
    x = torch.ones(64)
    with budget(h2d_bytes=256, syncs=0, device="cpu") as ledger:
        x.to("meta", non_blocking=True)
    assert ledger.summary().totals.h2d_bytes == 256
    with pytest.raises(BudgetExceeded) as caught, budget(h2d_bytes=256, syncs=0, device="cpu"):
        x.to("meta", non_blocking=True)
        x.to("meta")  # over-budget
    error = caught.value
    assert error.over == {"h2d_bytes": (512, 256), "syncs": (1, 0)}
    assert f"{HERE}:{_line('# over-budget')}" in str(error)
    assert "syncs: 1 > 0" in str(error) and "h2d_bytes: 512 > 256" in str(error)
    assert isinstance(error, gpuflow.GpuflowError)


def test_a_package_named_like_torch_is_a_caller_not_torch():
    """torchvision, torchmetrics and the like sit beside torch; their lines are the ones to
    name, as any other library's are."""
    beside = str(Path(torch.__file__).parent) + "metrics_like" + "/functional.py"
    code = compile("def read(x):\n    return x.to('meta', non_blocking=True)\n", beside, "exec")
    namespace: dict = {}
    exec(code, namespace)
    with TransferLedger("cpu") as ledger:
        namespace["read"](torch.ones(4))
    [event] = ledger.events
    assert event.location.endswith("metrics_like/functional.py:2")


def test_budget_as_a_decorator_checks_every_call():
    @budget(d2h_bytes=0, syncs=0, device="cpu")
    def step(download: bool) -> None:
        if download:
            Device("cpu").new_event().synchronize()

    step(False)
    with pytest.raises(BudgetExceeded, match=r"Event\.synchronize"):
        step(True)
    step(False)


def test_budget_refuses_to_decorate_what_runs_after_the_call():
    """A generator's body runs as it is iterated, after the checked call has returned: the
    decorator checked nothing at all."""

    def syncs():
        yield Device("cpu").new_event().synchronize()

    async def later():
        Device("cpu").synchronize()

    async def stream():
        yield 1

    for fn in (syncs, later, stream):
        with pytest.raises(TypeError, match=f"cannot check {fn.__name__}: .* inside it"):
            budget(syncs=0, device="cpu")(fn)


def test_errors_in_the_region_pass_through_unchanged():
    with pytest.raises(KeyError), budget(syncs=0, device="cpu"):
        Device("cpu").synchronize()
        raise KeyError("the body's own error wins")


def test_bad_limits_are_refused():
    with pytest.raises(gpuflow.GpuflowError, match="syncs must be a whole number"):
        budget(syncs=-1)


def test_the_pytest_marker_and_fixture(pytester):
    pytester.makepyfile(
        """
        import pytest, torch
        from gpuflow.device.accelerator import Device

        @pytest.mark.transfer_budget(syncs=0, device="cpu")
        def test_over():
            Device("cpu").synchronize()

        @pytest.mark.transfer_budget(h2d_bytes=40, device="cpu")
        def test_within():
            torch.ones(10).to("meta", non_blocking=True)

        def test_fixture(transfer_ledger):
            torch.ones(3).to("meta", non_blocking=True)
            assert transfer_ledger.summary().totals.h2d_bytes == 12
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", *plugin_args())
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*BudgetExceeded*", "*syncs: 1 > 0*"])


def test_interval_arithmetic():
    assert merged([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert intersection([(0, 10)], [(2, 3), (5, 12)]) == 1 + 5
    assert intersection([(0, 1)], [(1, 2)]) == 0


def test_metrics_from_device_activity():
    # One step of 10 ms: a 2 ms copy, half of it under a kernel, and 6 ms of kernels.
    activity = [
        Interval(0, 2000, stream=7, kind="h2d", nbytes=100_000_000),
        Interval(1000, 7000, stream=0, kind="kernel"),
    ]
    m = from_activity(
        activity,
        wall_us=10_000,
        steps=1,
        bytes_moved=100_000_000,
        useful_bytes=50_000_000,
        peak_h2d_gb_s=100.0,
    )
    assert m.transfer_us == 2000 and m.compute_us == 6000 and m.overlap_us == 1000
    assert m.transfer_overhead == pytest.approx(0.1)  # 1 ms exposed of 10
    assert m.overlap_efficiency == pytest.approx(1000 / 6000)
    assert m.memory_efficiency == pytest.approx(0.5)
    assert m.achieved_h2d_gb_s == pytest.approx(50.0) and m.link_utilisation == pytest.approx(0.5)


def test_a_profiler_trace_is_read_into_kernels_and_copies(tmp_path):
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 5, "args": {"stream": 7}},
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "ts": 0,
                "dur": 4,
                "args": {"stream": 13, "bytes": 4096},
            },
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoH (Device -> Pageable)",
                "ts": 20,
                "dur": 1,
                "args": {"stream": 7, "bytes": 4},
            },
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    activity = device_activity(json.loads(path.read_text()))
    assert [(a.kind, a.stream, a.nbytes, a.end - a.start) for a in activity] == [
        ("kernel", 7, 0, 5),
        ("h2d", 13, 4096, 4),
        ("d2h", 7, 4, 1),
    ]


def test_streamed_training_step_moves_only_its_token_ids(prepared, workdir):
    """The streamed path's budget, on the cpu for the logic, through the step the trainer
    runs: after warm-up, a step takes one batch of uint16 ids (B x (T+1) x 2 bytes, 16-byte
    aligned) and never waits."""
    config = resolve_config(
        "tiny",
        None,
        [*FAST, f"data.dir={prepared}", "train.steps=6", "train.data_path=streamed"],
    )
    trainer = Trainer(config, workdir / "runs" / "b", Device("cpu"))
    trainer.build(resume=False)
    ids = config.train.batch_size * (config.model.max_len + 1)
    with trainer.open_step(0, 6) as train_step:
        assert isinstance(train_step.batches, StreamedBatches)
        train_step(0)  # warm-up
        for step in range(1, 4):
            with budget(h2d_bytes=(2 * ids + 15) // 16 * 16, d2h_bytes=0, syncs=0, device="cpu"):
                train_step(step)


@pytest.mark.parametrize(("data_path", "bytes_per_id"), [("streamed", 2), ("resident", 0)])
def test_metrics_log_carries_bus_traffic_per_step(prepared, workdir, data_path, bytes_per_id):
    config = resolve_config(
        "tiny",
        None,
        [
            *FAST,
            f"data.dir={prepared}",
            "train.steps=8",
            "train.log_interval=4",
            f"train.data_path={data_path}",
        ],
    )
    result = Trainer(config, workdir / "runs" / "m", Device("cpu")).run()
    records = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [4, 8]
    ids = config.train.batch_size * (config.model.max_len + 1)
    for r in logged:
        assert r["h2d_bytes_per_step"] == bytes_per_id * ids  # uint16 ids, or none at all
        assert r["syncs_per_step"] == 0 and r["device_allocs_per_step"] == 0
        assert r["tokens_per_s"] > 0


@pytest.mark.parametrize(("steps", "counted"), [(3, [3]), (9, [4, 8]), (11, [4, 8, 11])])
def test_an_interval_the_runs_end_cuts_short_is_counted_too(prepared, workdir, steps, counted):
    """A run of fewer steps than an interval (any short trial) recorded no bus figures at
    all; its last step is counted where its interval has two steps or more."""
    sets = [*FAST, f"data.dir={prepared}", f"train.steps={steps}", "train.log_interval=4"]
    result = Trainer(
        resolve_config("tiny", None, sets), workdir / "runs" / "s", Device("cpu")
    ).run()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "h2d_bytes_per_step" in r] == counted
    assert [r["step"] for r in records if "loss" in r][-1] == steps
