"""StateSnapshot as a user meets it: capture, read, release; its layout, and the copy it
holds (GPU: tests/transfer/test_transfer_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from gpuflow.transfer.snapshot import Layout, StateSnapshot
from tests.helpers import mixed_state


def _state() -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.bfloat16)}}


def _capture_error(snapshots) -> RuntimeError | None:
    """The error a capture raises while an earlier snapshot holds the buffer, or None."""
    try:
        snapshots.capture(_state())
    except RuntimeError as exc:
        return exc
    return None


def _on_a_thread(job, timeout: float = 5.0) -> list:
    """Run ``job`` on a daemon thread: a hang fails the test instead of stalling the suite."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(job())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "capture() hung"
    return outcome


def test_state_snapshot_is_public():
    import gpuflow
    from gpuflow import StateSnapshot

    assert StateSnapshot.__name__ == "StateSnapshot" and "StateSnapshot" in dir(gpuflow)


def test_a_second_capture_before_release_is_an_error_not_a_hang():
    from gpuflow import StateSnapshot

    def loop() -> tuple:
        snapshots = StateSnapshot("cpu")
        first = snapshots.capture(_state())
        error = _capture_error(snapshots)
        first.release()
        return error, snapshots.capture(_state())  # released: the next capture works

    [(error, again)] = _on_a_thread(loop)
    assert error is not None and "release()" in str(error)
    again.wait()
    assert torch.equal(again.tensors("model")["w"], torch.arange(6.0))


def test_a_capture_waiting_on_a_writer_that_died_is_an_error():
    from gpuflow import StateSnapshot

    def loop() -> object:
        snapshots = StateSnapshot("cpu")
        snap = snapshots.capture(_state())
        writer = threading.Thread(target=snap.wait)  # reads, then ends without release()
        writer.start()
        writer.join()
        return snapshots.capture(_state())

    [outcome] = _on_a_thread(loop)
    assert isinstance(outcome, RuntimeError) and "release()" in str(outcome)


def test_a_capture_waits_for_a_live_writer_to_release():
    from gpuflow import StateSnapshot

    snapshots = StateSnapshot("cpu")
    snap = snapshots.capture(_state())
    go = threading.Event()

    def write() -> None:  # the checkpoint writer's part: wait, read, release
        snap.wait()
        go.wait(5)
        snap.tensors("model")
        snap.release()

    writer = threading.Thread(target=write)
    writer.start()
    threading.Timer(0.2, go.set).start()
    [again] = _on_a_thread(lambda: snapshots.capture(_state()))  # waits ~0.2 s, then works
    writer.join()
    assert snap.released and not again.released


def test_releasing_an_old_snapshot_again_does_not_free_the_current_one():
    from gpuflow import StateSnapshot

    def loop() -> tuple:
        snapshots = StateSnapshot("cpu")
        first = snapshots.capture(_state())
        first.release()
        second = snapshots.capture(_state())
        first.release()  # again: the buffer still belongs to `second`
        error = _capture_error(snapshots)
        second.release()
        return error, second

    [(error, second)] = _on_a_thread(loop)
    assert isinstance(error, RuntimeError)
    with pytest.raises(RuntimeError, match="released"):
        second.tensors("model")  # its bytes may be overwritten by the next capture


def test_layout_puts_every_tensor_where_its_type_can_be_read():
    layout = Layout.of(mixed_state())
    for group, slots in layout.groups.items():
        assert layout.offsets[group] % 64 == 0
        ends = 0
        for slot in slots:
            assert slot.start == ends  # end to end: a safetensors body has no holes
            assert (layout.offsets[group] + slot.start) % slot.dtype.itemsize == 0
            ends += slot.nbytes
        assert layout.sizes[group] == ends


def test_snapshot_copies_every_tensor_and_waits_for_its_release():
    snapshots = StateSnapshot("cpu")
    state = mixed_state()
    snap = snapshots.capture(state)
    snap.wait()
    for group, tensors in state.items():
        copied = snap.tensors(group)
        assert copied.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(copied[name], tensor), name
    state["model"]["w"].add_(1)  # a copy, not a view of the live state
    assert not torch.equal(snap.tensors("model")["w"], state["model"]["w"])

    second: list = []
    taker = threading.Thread(target=lambda: second.append(snapshots.capture(state)))
    taker.start()
    taker.join(timeout=0.2)
    assert taker.is_alive() and not second  # the host buffer is still being read
    snap.release()
    taker.join(timeout=5)
    assert second and torch.equal(second[0].tensors("model")["w"], state["model"]["w"])


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"w": torch.ones(2)}, "group 'w' is a Tensor: pass a state dict in a group"),
        ({"model": {"w": [1.0, 2.0]}}, "'model'/'w' is a list, not a tensor"),
        ([torch.ones(2)], "got list"),
        ({"model": {"w": torch.eye(3).to_sparse()}}, "'model'/'w' is torch.sparse_coo"),
        ({"opt": {0: torch.ones(2), "lr": torch.ones(1)}}, "group 'opt' mixes int and str"),
    ],
)
def test_anything_but_groups_of_named_tensors_is_one_line_and_frees_the_buffer(given, words):
    from gpuflow.common.errors import GpuflowError

    snapshots = StateSnapshot("cpu")
    with pytest.raises(GpuflowError, match="capture takes") as error:
        snapshots.capture(given)
    assert words in str(error.value) and "\n" not in str(error.value)
    snap = snapshots.capture(_state())  # the failed capture held nothing
    snap.wait()
    assert torch.equal(snap.tensors("model")["w"], torch.arange(6.0))
    snap.release()
