"""The transfer ledger on the cpu: host reads that would wait on a GPU counted as syncs, the
waits of autograd's device threads, and how it counts (kernels at one dispatch key, with
version counts, scalars and inference mode left as they were).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gpuflow.accounting.budgets import BudgetExceeded, budget
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.accounting.ledger import threads as ledger_threads
from gpuflow.device.accelerator import Device
from tests.helpers import child_env, line_holding

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


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
