"""The transfer ledger on the cpu: ledgers and budgets composed (nested, re-entered, across
threads, with the pytest marker), and accounting that leaves compiled code as it was.

Meta tensors stand in for device tensors, as in test_ledger.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.accounting.ledger import TransferLedger
from tests.helpers import RecordingBackend, child_env, line_holding, plugin_args

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


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
