"""The transfer ledger on the cpu: copies, syncs, locations, steps, nesting, budgets, metrics.

Meta tensors stand in for device tensors: copies to them go through the same dispatch
path and are counted like real ones, so the accounting runs without an accelerator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gpuflow
from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.accounting.crosscheck import Interval, device_activity
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.accounting.ledger import threads as ledger_threads
from gpuflow.accounting.metrics import from_activity, intersection, merged
from gpuflow.data.resident.sources import StreamedBatches
from gpuflow.device.accelerator import Device, HostEvent
from gpuflow.train.config import resolve_config
from gpuflow.train.trainer import Trainer
from gpuflow.transfer.loader import DeviceLoader
from tests.helpers import FAST, RecordingBackend, child_env, line_holding, plugin_args

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


# ---- ledgers and budgets compose ------------------------------------------------------------


def _meta_copy() -> None:
    torch.zeros(4).to("meta", non_blocking=True)  # 16 bytes host->device, no accelerator


def _h2d(ledger: TransferLedger) -> int:
    return ledger.summary().totals.h2d_bytes


def test_ledgers_that_counted_alike_are_still_two_and_leave_in_any_order():
    outer, inner = TransferLedger("cpu"), TransferLedger("cpu")
    with outer:
        with inner:
            _meta_copy()  # both hold the same events now: equal, were they compared by value
        _meta_copy()  # the outer one is still counting
    assert (_h2d(outer), _h2d(inner)) == (32, 16)
    first, second = TransferLedger("cpu"), TransferLedger("cpu")
    first.__enter__()
    second.__enter__()
    _meta_copy()
    first.__exit__(None, None, None)  # the outer one leaves first
    _meta_copy()
    second.__exit__(None, None, None)
    assert (_h2d(first), _h2d(second)) == (16, 32)
    assert _get_current_dispatch_mode() is None  # the recorder left with the last ledger


def test_a_budget_inside_a_ledger_and_a_ledger_inside_a_budget():
    with TransferLedger("cpu") as ledger:
        with budget(syncs=0, device="cpu"):
            _meta_copy()
        with budget(h2d_bytes=16, device="cpu") as inner, TransferLedger("cpu") as innermost:
            _meta_copy()
    assert (_h2d(ledger), _h2d(inner), _h2d(innermost)) == (32, 16, 16)
    assert _get_current_dispatch_mode() is None


def test_a_budget_entered_again_inside_itself_checks_both_regions():
    limit = budget(h2d_bytes=16, device="cpu")
    with pytest.raises(BudgetExceeded) as caught, limit:
        _meta_copy()
        with limit:
            _meta_copy()  # 16 bytes in the inner region: within it
    assert caught.value.over == {"h2d_bytes": (32, 16)}  # the outer region saw both
    assert _get_current_dispatch_mode() is None


def test_one_budget_guarding_two_threads_checks_each_threads_region():
    # The clean thread leaves first: its exit must close its own region, not the other's.
    guard, x, results = budget(syncs=0, device="cpu"), torch.ones(3), {}
    clean_in, dirty_in = threading.Event(), threading.Event()

    def clean() -> None:
        with guard:
            clean_in.set()
            dirty_in.wait()
            x * 2
        results["clean"] = "passed"

    def dirty() -> None:
        clean_in.wait()
        try:
            with guard:
                dirty_in.set()
                time.sleep(0.2)
                x.sum().item()  # a host read: over syncs=0
            results["dirty"] = "passed"
        except BudgetExceeded:
            results["dirty"] = "over"

    threads = [threading.Thread(target=clean), threading.Thread(target=dirty)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {"clean": "passed", "dirty": "over"}


def test_the_marker_and_the_fixture_in_one_test(pytester, monkeypatch):
    pytester.makepyfile(
        """
        import pytest
        import torch

        @pytest.mark.transfer_budget(h2d_bytes=16, device="cpu")
        def test_both(transfer_ledger):
            torch.zeros(4).to("meta")
            assert transfer_ledger.summary().totals.h2d_bytes == 16
        """
    )
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the child imports this gpuflow
    pytester.runpytest_subprocess("-p", "gpuflow", *plugin_args()).assert_outcomes(passed=1)


def test_an_at_site_budget_raises_at_the_operation_that_goes_over():
    x = torch.ones(64)  # 256 bytes
    done = []
    limited = budget(h2d_bytes=300, device="cpu", at_site=True)
    with pytest.raises(BudgetExceeded) as caught, limited as ledger:
        x.to("meta", non_blocking=True)
        done.append("first")
        x.to("meta", non_blocking=True)  # at-site-copy
        done.append("second")
    assert done == ["first"]  # the region stopped at the second copy
    assert caught.value.over == {"h2d_bytes": (512, 300)}
    site = f"{HERE}:{_line('# at-site-copy')}"
    assert site in str(caught.value)
    frames = [(Path(e.path).name, e.lineno + 1) for e in caught.traceback]
    assert (HERE, _line("# at-site-copy")) in frames  # the traceback points at it too
    assert len(ledger.events) == 2
    # a read of device data is stopped before the host would wait for it
    y = torch.ones(4, device="meta")
    no_syncs = budget(syncs=0, device="cpu", at_site=True)
    with pytest.raises(BudgetExceeded, match="syncs: 1 > 0"), no_syncs:
        y.sum().item()
    assert _get_current_dispatch_mode() is None  # nothing left installed


def test_the_marker_fails_at_the_site_when_asked(pytester):
    pytester.makepyfile(
        """
        import pytest
        from gpuflow.device.accelerator import Device

        @pytest.mark.transfer_budget(syncs=0, device="cpu", at_site=True)
        def test_over():
            Device("cpu").synchronize()
            raise AssertionError("not reached")
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", *plugin_args())
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*BudgetExceeded*", "*syncs: 1 > 0*"])
    result.stdout.no_fnmatch_line("*not reached*")


# ---- accounting does not change what it measures ----------------------------------------


def test_a_compiled_function_stays_compiled_inside_a_ledger_and_after_it():
    backend = RecordingBackend()

    @torch.compile(backend=backend)
    def step(x):
        return (x.sin() * 2).to("meta", non_blocking=True)  # compiled-copy

    x = torch.ones(4)
    with TransferLedger("cpu") as ledger:
        step(x)
    assert (backend.compiled, backend.runs) == (1, 1)  # it ran compiled, not eagerly
    [copy] = ledger.events  # and what the compiled graph did was counted
    assert (copy.kind, copy.nbytes) == ("h2d", 16)
    step(x)
    with budget(syncs=0, device="cpu") as limited:
        step(x)
    step(x)
    assert (backend.compiled, backend.runs) == (1, 4)  # no recompiles, no eager fallback
    assert limited.summary().totals.h2d_bytes == 16


def test_a_step_first_compiled_under_the_marker_stays_compiled_after_it(pytester):
    pytester.makepyfile(
        """
        import pytest, torch

        runs, graphs = [], []
        def backend(gm, inputs):
            graphs.append(gm)
            return lambda *args: runs.append(1) or gm.forward(*args)

        @torch.compile(backend=backend)
        def step(x):
            return x.cos() + 1

        @pytest.mark.transfer_budget(syncs=0, device="cpu")
        def test_budgeted():
            step(torch.ones(3))  # the first call: compiled here, under the budget
            assert (len(graphs), len(runs)) == (1, 1)

        def test_after():
            step(torch.ones(3))
            assert (len(graphs), len(runs)) == (1, 2)
        """
    )
    pytester.runpytest("-p", "no:cacheprovider", *plugin_args()).assert_outcomes(passed=2)


# ---- on the cpu, the reads that would wait for a GPU count as syncs -----------------------


def test_cpu_budget_fails_on_reads_that_would_wait_on_a_gpu():
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    with pytest.raises(BudgetExceeded) as caught, budget(syncs=0, device="cpu"):
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            print(f"loss {loss.item():.3f}")  # would-sync-item
    assert caught.value.over == {"syncs": (3, 0)}
    assert f"{HERE}:{_line('# would-sync-item')}" in str(caught.value)
    assert "would wait on a GPU" in str(caught.value)


def test_every_kind_of_host_read_counts_on_the_cpu(capsys):
    x = torch.arange(6, dtype=torch.float32)
    with TransferLedger("cpu") as ledger:
        x.sum().item()  # read-item
        x.tolist()  # read-tolist
        bool(x[0] > 0)  # read-bool
        print(x)  # read-print
        x.nonzero()  # read-nonzero
        x[x > 2]  # read-mask
        x.sum() * 2  # compute: nothing counted
        x.numpy()  # a view of host memory, as it is on a GPU machine's host tensors
    syncs = [e for e in ledger.events if e.kind == "sync"]
    markers = ("item", "tolist", "bool", "print", "nonzero", "mask")
    assert len(syncs) == len(markers), [e.describe() for e in syncs]
    for event, marker in zip(syncs, markers, strict=True):
        assert event.location.endswith(f"{HERE}:{_line(f'# read-{marker}')}"), event
        assert "would wait on a GPU" in event.op
    assert [e for e in ledger.events if e.kind != "sync"] == []  # nothing crossed a bus
    assert "tensor([0., 1., 2., 3., 4., 5.])" in capsys.readouterr().out


def test_host_reads_that_never_wait_on_a_gpu_are_not_counted_on_the_cpu():
    """An optimizer's host-side step counters: it reads them on a GPU machine's host too."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    with budget(syncs=0, device="cpu") as ledger:
        optimizer.step()  # reads its cpu step tensor with .item()
        optimizer.zero_grad()
    assert ledger.events == []


def test_printing_a_device_tensor_counts_as_a_wait():
    x = torch.ones(3, device="meta")  # stands in for an accelerator's tensor
    with TransferLedger("cpu") as ledger:
        text = repr(x)  # print-device
    assert "meta" in text
    [sync] = ledger.events
    assert sync.kind == "sync" and sync.location.endswith(f"{HERE}:{_line('# print-device')}")
    assert torch._tensor_str._str.__module__ == "torch._tensor_str"  # unwrapped after


# ---- threads that work for the region: autograd's device threads ---------------------------


def test_waits_on_a_thread_that_works_for_a_backward_are_counted_at_their_line():
    """On CUDA a backward and its gradient hooks run on autograd's device thread, which takes
    over the calling thread's thread-local Python objects and function modes; a thread that
    does the same here, from inside a backward, is counted the same. A thread that does not
    is not."""
    host = torch.ones(4)
    w = torch.ones(3, requires_grad=True)
    taken_over = []
    carried_objects: list = []
    inner: list[TransferLedger] = []

    def on_worker() -> None:
        # What the autograd engine does (the list is kept in one of the two).
        for obj in carried_objects:
            ledger_threads._stash(obj)
        for mode in taken_over:
            torch.overrides._push_mode(mode)
        try:
            host.to("meta")  # hook-copy
            Device("cpu").synchronize()  # hook-wait
            with TransferLedger("cpu") as own:  # a hook's own ledger: both count what it sees
                host.to("meta", non_blocking=True)
            host.to("meta", non_blocking=True)  # and the carried one still counts after it
            inner.append(own)
        finally:
            for _ in taken_over:
                torch.overrides._pop_mode()

    def in_worker_thread() -> None:
        worker = threading.Thread(target=on_worker)
        worker.start()
        worker.join()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        taken_over[:] = torch.overrides._get_current_function_mode_stack()
        key = ledger_threads._CARRIED
        carried_objects[:] = [torch._C._get_obj_in_tls(key)] if torch._C._is_key_in_tls(key) else []
        in_worker_thread()
        taken_over.clear()
        carried_objects.clear()
        return grad

    w.register_hook(hook)
    with TransferLedger("cpu") as ledger:
        (w * 2).sum().backward()
        in_worker_thread()  # a thread that takes nothing over works for no ledger
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [s.op for s in syncs] == ["blocking h2d to", "Device.synchronize"]
    assert syncs[0].location.endswith(f"{HERE}:{_line('# hook-copy')}")
    # The worker inside the backward: 3 copies for the carried ledger, 1 for its own; the
    # worker that takes nothing over: only its own ledger's copy.
    assert [len([e for e in led.events if e.kind == "h2d"]) for led in inner] == [1, 1]
    assert len([e for e in ledger.events if e.kind == "h2d"]) == 3
    assert syncs[1].location.endswith(f"{HERE}:{_line('# hook-wait')}")


# ---- how it counts: kernels at one dispatch key, not a Python call per operation ------------


def _counting_kernel_installed() -> bool:
    table = torch._C._dispatch_dump_table("aten::copy_")
    [line] = [row for row in table.splitlines() if row.startswith("ADInplaceOrView:")]
    return "gpuflow" in line


def test_only_the_watched_operations_reach_python_and_torch_s_kernels_come_back():
    x = torch.ones(4)
    assert not _counting_kernel_installed()
    with TransferLedger("cpu") as ledger:
        assert _get_current_dispatch_mode() is None  # no mode that every operation would pay
        assert _counting_kernel_installed()
        x.to("meta", non_blocking=True)
    assert not _counting_kernel_installed()
    assert [e.kind for e in ledger.events] == ["h2d"]


def test_in_place_writes_keep_their_version_counts_under_a_ledger():
    """The counter stands where torch bumps an in-place write's version: autograd must still
    see a saved tensor changed under it."""

    def bumps(write) -> int:
        a = torch.zeros(4)
        before = a._version
        write(a)
        return a._version - before

    writes = (
        lambda a: a.copy_(torch.ones(4)),
        lambda a: a.index_put_((torch.tensor([1, 2]),), torch.tensor([5.0, 6.0])),
        lambda a: a.__setitem__(a > -1, 3.0),
    )
    outside = [bumps(write) for write in writes]
    with TransferLedger("cpu"):
        inside = [bumps(write) for write in writes]
        w = torch.ones(3, requires_grad=True)
        saved = w.exp()
        out = saved.exp()  # exp saves its output for the backward
        saved.copy_(torch.zeros(3))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    assert inside == outside and all(n >= 1 for n in inside)


def test_python_scalars_written_under_a_ledger_keep_their_values_and_types():
    expected = []
    got = []
    for results in (expected, got):
        halves = torch.zeros(4, dtype=torch.float16)
        flags = torch.zeros(4, dtype=torch.bool)
        counts = torch.zeros(4, dtype=torch.int32)
        context = TransferLedger("cpu") if results is got else torch.no_grad()
        with context:
            halves[halves == 0] = 1.5  # a wrapped float, written as float16
            flags[counts == 0] = True
            counts[counts == 0] = 7
            mixed = counts.float().add_(2)  # int and float mixed: a cast inside the op
        results += [halves, flags, counts, mixed]
    for want, have in zip(expected, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_inference_mode_is_counted_however_the_two_nest():
    host = torch.arange(4.0)
    with TransferLedger("cpu") as outer:
        with torch.inference_mode():
            made = host * 2  # an inference tensor
            made.sum().item()  # infer-item
            made.to("meta", non_blocking=True)  # infer-copy
        made.tolist()  # after-tolist
    with torch.inference_mode(), TransferLedger("cpu") as inner:
        (host * 2).sum().item()  # inner-item
    assert _get_current_dispatch_mode() is None
    assert [(e.kind, e.location.split(":")[-1]) for e in outer.events] == [
        ("sync", str(_line("# infer-item"))),
        ("h2d", str(_line("# infer-copy"))),
        ("sync", str(_line("# after-tolist"))),
    ]
    [item] = inner.events
    assert item.location.endswith(f"{HERE}:{_line('# inner-item')}")


def test_a_copy_under_a_users_own_dispatch_mode_counts_once():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with TransferLedger("cpu") as ledger, Watching():
        torch.ones(4).to("meta", non_blocking=True)
    assert "aten._to_copy.default" in seen
    assert [e.kind for e in ledger.events] == ["h2d"]


def test_python_numbers_copied_into_tensors_wrap_and_are_not_counted_as_crossings():
    """copy_ of a Python number converts it as torch does (300 into uint8 wraps to 44), and
    no host memory crosses for it; a thread with no ledger is not changed by one elsewhere."""
    plain = torch.zeros(2, dtype=torch.uint8).copy_(300)
    device = torch.empty(3, device="meta")
    with TransferLedger("cpu") as ledger:
        counted = torch.zeros(2, dtype=torch.uint8).copy_(300)
        device.copy_(1.5)
        results = []
        worker = threading.Thread(target=lambda: results.append(torch.zeros(1).copy_(2**40)))
        worker.start()
        worker.join()
    assert torch.equal(counted, plain) and counted.tolist() == [44, 44]
    assert results[0].item() == float(2**40)
    assert [e for e in ledger.events if e.kind != "sync"] == []


def test_an_in_place_write_to_an_inference_tensor_fails_under_a_ledger_as_without():
    with torch.inference_mode():
        made = torch.ones(3)
    with pytest.raises(RuntimeError, match="inference"):
        made.copy_(torch.zeros(3))
    with TransferLedger("cpu"), pytest.raises(RuntimeError, match="inference"):
        made.copy_(torch.zeros(3))


def test_repeat_interleave_waits_only_without_its_output_size():
    counts = torch.tensor([1, 2, 3])
    with TransferLedger("cpu") as ledger:
        torch.repeat_interleave(counts)  # repeat-wait
        counts.repeat_interleave(counts, output_size=6)  # told the size: no wait
    [sync] = ledger.events
    assert sync.location.endswith(f"{HERE}:{_line('# repeat-wait')}")
    assert "repeat_interleave" in sync.op


def test_ledgers_closed_out_of_order_inside_inference_mode_keep_counting():
    host = torch.arange(4.0)
    with torch.inference_mode():
        outer = TransferLedger("cpu").__enter__()
        inner = TransferLedger("cpu").__enter__()
        outer.__exit__(None, None, None)
        (host * 2).sum().item()
        inner.__exit__(None, None, None)
    assert [e.kind for e in inner.events] == ["sync"]
    assert outer.events == []
    assert _get_current_dispatch_mode() is None


def test_a_ledger_opened_on_short_lived_threads_leaves_the_process_to_exit_cleanly(tmp_path):
    """torch frees what a thread left in its thread-local objects as the thread ends; at
    interpreter exit that aborted the process. The ledger leaves nothing there."""
    keys = (ledger_threads._CARRIED, ledger_threads._PROBE)
    left = []

    def on_a_thread() -> None:
        with TransferLedger("cpu"):
            torch.ones(2).to("meta")
        left.extend(key for key in keys if torch._C._is_key_in_tls(key))

    if ledger_threads._CAN_REMOVE:  # a torch that cannot take them out uses none off main
        ledger_threads._stash_steals = None  # probe again, on this thread
        worker = threading.Thread(target=on_a_thread)
        worker.start()
        worker.join()
        assert left == []
    script = tmp_path / "threads.py"
    script.write_text(
        "from concurrent.futures import ThreadPoolExecutor\n"
        "import torch\n"
        "from gpuflow.accounting.ledger import TransferLedger\n"
        "def work(_):\n"
        "    with TransferLedger('cpu') as ledger:\n"
        "        torch.ones(2).sum().item()\n"
        "    return len(ledger.events)\n"
        "with ThreadPoolExecutor(4) as pool:\n"
        "    print(list(pool.map(work, range(8))))\n"
    )
    for _ in range(3):  # the abort came 1 run in 5
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str([1] * 8)
