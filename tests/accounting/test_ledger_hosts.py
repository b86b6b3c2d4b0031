"""The ledger's verdicts wherever code runs: reads made at a compiled function's graph break
are counted (torch.compile does not trace the counting kernels); a ledger for the cpu
("auto" on a machine without a GPU) counts the reads of host data that would wait were the
data on a GPU, while a ledger for a GPU ("auto" on a machine with one) counts only what
waits on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.device import accelerator
from gpuflow.device.accelerator import Device
from tests.helpers import RecordingBackend, line_holding

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


# ---- reads at a compiled function's graph breaks -------------------------------------------


@pytest.mark.parametrize("first_call", ["before", "inside"])
def test_an_item_at_a_compiled_functions_graph_break_is_counted(first_call):
    backend = RecordingBackend()

    @torch.compile(backend=backend)
    def step(x):
        total = x.sin().sum()
        scale = total.item()  # compiled-item
        values = (x * scale).tolist()  # compiled-tolist
        return x * len(values)

    x = torch.ones(4)
    if first_call == "before":
        step(x)
    with TransferLedger("cpu") as ledger:
        step(x)
        step(x)
    syncs = [e for e in ledger.events if e.kind == "sync"]
    assert [e.op for e in syncs] == 2 * [
        "item (would wait on a GPU)",
        "tolist (would wait on a GPU)",
    ]
    for event, marker in zip(syncs, 2 * ["# compiled-item", "# compiled-tolist"], strict=True):
        assert event.location.endswith(f"{HERE}:{_line(marker)}"), event
    # The compiled graphs ran, not the function eagerly, and nothing was compiled again.
    runs_inside = 2 * backend.compiled
    assert backend.runs == runs_inside + (backend.compiled if first_call == "before" else 0)
    compiled = backend.compiled
    step(x)
    assert backend.compiled == compiled


def test_a_budget_stops_a_compiled_functions_item_at_its_line():
    @torch.compile(backend="eager")
    def step(x):
        return x * x.sum().item()  # stopped-item

    x = torch.ones(3)
    step(x)
    with pytest.raises(BudgetExceeded) as caught, budget(syncs=0, device="cpu", at_site=True):
        step(x)
    assert caught.value.over == {"syncs": (1, 0)}
    assert f"{HERE}:{_line('# stopped-item')}" in str(caught.value)


# ---- which reads a ledger counts, by its device --------------------------------------------


@pytest.fixture
def a_gpu_machine(monkeypatch):
    """This machine as one with a CUDA device: "auto" resolves to it (nothing runs there)."""
    monkeypatch.setattr(accelerator, "_backend_available", lambda kind: kind in ("cpu", "cuda"))
    monkeypatch.setattr(accelerator, "_backend_count", lambda kind: 1)
    assert Device.resolve("auto").type == "cuda"


def _host_read_under_an_auto_budget() -> BudgetExceeded:
    scores = torch.arange(4.0)  # a host tensor, on either machine
    with pytest.raises(BudgetExceeded) as caught, budget(syncs=0):
        scores.sum().item()  # auto-item
    return caught.value


def test_an_auto_budget_counts_a_host_read_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the next test is its case")
    error = _host_read_under_an_auto_budget()
    assert error.over == {"syncs": (1, 0)} and "would wait on a GPU" in str(error)
    assert f"{HERE}:{_line('# auto-item')}" in str(error)


def test_an_auto_budget_on_a_gpu_machine_leaves_reads_of_host_data_alone(a_gpu_machine):
    with budget(syncs=0) as ledger:  # "auto" is the GPU: a host read waits for nothing there
        torch.arange(4.0).sum().item()
    assert not ledger.host_reads and ledger.events == []


def test_a_ledger_for_a_named_accelerator_counts_only_what_waits_on_it(a_gpu_machine):
    cuda = Device("cuda", 0)
    with TransferLedger(cuda) as ledger:  # a host read: no wait on that device
        torch.arange(4.0).sum().item()
    assert not ledger.host_reads and ledger.events == []
    with budget(syncs=0, device=cuda):
        torch.arange(4.0).sum().item()
    # Named as the cpu, on any machine, host reads count.
    with TransferLedger("cpu") as ledger:
        torch.arange(4.0).sum().item()
    assert ledger.host_reads and len(ledger.events) == 1


def test_reads_of_host_data_on_a_gpu_machine_too_stay_uncounted_under_auto(a_gpu_machine):
    """An optimizer's host-side step counters: read on a GPU machine's host as well."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    with budget(syncs=0) as ledger:
        optimizer.step()
        optimizer.zero_grad()
    assert ledger.events == []
