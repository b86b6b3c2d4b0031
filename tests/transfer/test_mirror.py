"""HostMirror, AsyncScalars and host snapshots on the cpu path (GPU: test_transfer_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.mirror import HostMirror, host_snapshot
from gpuflow.transfer.scalars import AsyncScalars


def test_async_scalars_report_means_per_interval():
    scalars = AsyncScalars(("loss", "norm"), Device("cpu"), depth=2)
    for v in (1.0, 2.0, 3.0):
        scalars.add(loss=torch.tensor(v), norm=torch.tensor(10 * v))
    assert scalars.flush(3) == [(3, {"loss": 2.0, "norm": 20.0})]
    scalars.add(loss=torch.tensor(5.0), norm=torch.tensor(1.0))
    assert scalars.drain(4) == [(4, {"loss": 5.0, "norm": 1.0})]
    assert scalars.flush(5) == []  # nothing accumulated since


def test_the_captured_form_of_async_scalars_requires_every_name():
    scalars = AsyncScalars(("loss", "norm"), Device("cpu"))
    with pytest.raises(ValueError, match="exactly"):
        scalars.accumulate(loss=torch.tensor(1.0))  # a graph sums every name, every step


def test_host_snapshot_is_a_detached_copy():
    weights = {"w": torch.arange(6.0).view(2, 3).t(), "b": torch.ones(3, requires_grad=True)}
    snap = host_snapshot(weights)
    weights["w"].add_(100)
    assert snap["w"].is_contiguous()
    torch.testing.assert_close(snap["w"], torch.arange(6.0).view(2, 3).t())
    assert not snap["b"].requires_grad


def test_mirror_fetches_once_until_the_tensor_changes():
    weights = torch.arange(12.0).view(3, 4)
    mirror = HostMirror(weights, writes="tracked")
    np.testing.assert_array_equal(mirror.numpy(), weights.numpy())
    mirror.numpy()
    assert (mirror.stats.misses, mirror.stats.hits, mirror.stats.bytes_fetched) == (1, 1, 48)
    weights.mul_(2)  # an in-place op bumps the version counter
    assert not mirror.is_fresh()
    assert mirror.numpy()[2, 3] == 22.0
    assert mirror.stats.misses == 2


def test_mark_dirty_covers_writes_a_tracked_mirror_was_promised_it_would_be_told_of():
    weights = torch.zeros(4)
    mirror = HostMirror(weights, writes="tracked")
    mirror.numpy()
    weights.data[0] = 7.0  # skips the version counter, as graph replays do
    mirror.mark_dirty()  # the part "tracked" leaves to the user
    assert not mirror.is_fresh()
    assert mirror.numpy()[0] == 7.0
    assert mirror.is_fresh()


def test_reading_a_stale_mirror_fetches_only_the_bytes_asked_for():
    table = torch.randn(1000, 64)
    mirror = HostMirror(table, writes="tracked")
    row = mirror[17]
    np.testing.assert_array_equal(row, table[17].numpy())
    assert mirror.stats.bytes_fetched == 64 * 4  # one row, not the 256 KB table
    assert mirror[5, 3] == table[5, 3].item()
    assert mirror.stats.bytes_fetched == 64 * 4 + 4
    mirror.numpy()
    before = mirror.stats.bytes_fetched
    assert mirror[999, 63] == table[999, 63].item()  # fresh now: served from the copy
    assert mirror.stats.bytes_fetched == before


def test_host_views_are_read_only_and_never_touch_the_device_copy():
    weights = torch.ones(8)
    mirror = HostMirror(weights, writes="tracked")
    view = mirror.numpy()
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 5.0
    with pytest.raises(ValueError, match="read-only"):
        mirror[2:4][0] = 5.0
    version = weights._version
    mirror.numpy()
    mirror[1:3]
    assert weights._version == version and mirror.is_fresh()


def test_refresh_async_is_adopted_only_if_the_tensor_did_not_change_since():
    weights = torch.zeros(3)
    mirror = HostMirror(weights)
    mirror.refresh_async()
    assert mirror.numpy().tolist() == [0.0, 0.0, 0.0]
    assert mirror.stats.misses == 0  # the refresh had already fetched it
    weights.add_(1)
    mirror.refresh_async()
    weights.add_(1)  # changed after the refresh was queued: the refresh is stale
    assert mirror.numpy().tolist() == [2.0, 2.0, 2.0]


def test_async_scalars_take_what_a_training_loop_has():
    scalars = AsyncScalars(["loss", "acc", "lr"])  # device: auto
    scalars.add(loss=torch.tensor(2.0), acc=0.5, lr=torch.tensor([1e-3]))  # 0-d, float, (1,)
    scalars.add(loss=torch.tensor(4.0))  # a subset: acc and lr keep one value each
    scalars.add(loss=1e-8, acc=torch.tensor(0.25, dtype=torch.float64))
    [(tag, means)] = scalars.drain(3)
    assert tag == 3
    assert means["loss"] == (2.0 + 4.0 + 1e-8) / 3  # float64 sums: the 1e-8 is not lost
    assert means["acc"] == 0.375 and means["lr"] == pytest.approx(1e-3)
    scalars.add(acc=1.0)
    assert scalars.drain(4) == [(4, {"acc": 1.0})]  # names given in no add() are left out
    with pytest.raises(ValueError, match="shape"):
        scalars.add(loss=torch.ones(3))
    with pytest.raises(ValueError, match="names from"):
        scalars.add(los=1.0)
    assert AsyncScalars(["x"], torch.device("cpu")).device == AsyncScalars(["x"], "cpu").device
    for complex_value in (1 + 2j, torch.tensor(1 + 2j)):
        with pytest.raises(ValueError, match="takes a real number"):
            scalars.add(loss=complex_value)


@pytest.mark.parametrize(
    "refused", [{"loss": 5.0, "acc": torch.ones(3)}, {"loss": 5.0, "acc": "high"},
                {"loss": torch.tensor(5.0), "acc": 1j}],
    ids=["a-tensor-of-three", "a-string", "complex"],
)  # fmt: skip
def test_a_refused_add_adds_nothing(refused):
    """The loss of a refused call was summed before its later name was refused, and not
    counted: the next mean held it."""
    scalars = AsyncScalars(["loss", "acc"], "cpu")
    with pytest.raises(ValueError, match=r"add\(acc=...\) takes"):
        scalars.add(**refused)
    scalars.add(loss=1.0, acc=0.5)
    assert scalars.drain(1) == [(1, {"loss": 1.0, "acc": 0.5})]


def test_async_scalars_added_from_several_threads_lose_nothing():
    import threading

    scalars = AsyncScalars("loss", "cpu")

    def adds() -> None:
        for _ in range(10_000):
            scalars.add(loss=1.0)

    threads = [threading.Thread(target=adds) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert scalars.drain(1) == [(1, {"loss": 1.0})]


def test_a_host_mirror_of_a_parameter_reads_like_any_tensor():
    weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    mirror = HostMirror(weight)
    assert mirror.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    with torch.no_grad():
        weight.add_(1)  # an optimizer step
    assert not mirror.is_fresh()
    assert mirror[1].tolist() == [4, 5, 6]


# ---- what users met in their own loops --------------------------------------------------------


def _trained_param(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    param.grad = torch.ones(2, 3)
    return param, torch.optim.AdamW([param], lr=0.1, fused=fused)


@pytest.mark.parametrize("writes", ["unknown", "tracked"])
def test_a_mirror_is_fresh_after_a_fused_adamw_step(writes):
    from gpuflow import HostMirror

    param, optimizer = _trained_param(fused=True)
    mirror = HostMirror(param, writes=writes)
    mirror.numpy()
    version = param._version
    optimizer.step()
    assert param._version == version  # the fused kernel leaves the counter alone
    assert not mirror.is_fresh()
    np.testing.assert_array_equal(mirror.numpy(), param.detach().numpy())
    np.testing.assert_array_equal(mirror[1], param.detach()[1].numpy())


def test_a_tracked_mirror_sees_the_step_of_a_fused_optimizer_dropped_since():
    # A fine-tuning helper makes its optimizer, steps and returns: the optimizer is gone by
    # the time the mirror is read, and its step (no version bump) must still count.
    import gc

    from gpuflow import HostMirror

    param, optimizer = _trained_param(fused=True)
    mirror = HostMirror(param, writes="tracked")
    mirror.numpy()
    optimizer.step()
    del optimizer
    gc.collect()
    assert not mirror.is_fresh()
    np.testing.assert_array_equal(mirror.numpy(), param.detach().numpy())
    assert mirror.is_fresh()  # the step is older than the copy now


def test_a_mirror_refuses_to_be_copied_and_leaves_its_tensor_whole():
    import copy
    import gc
    import pickle

    from gpuflow.common.errors import GpuflowError

    weights = torch.arange(1000.0)
    mirror = HostMirror(weights, writes="tracked")
    mirror.numpy()
    for duplicate in (copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        with pytest.raises(GpuflowError, match="cannot be copied or pickled"):
            duplicate(mirror)
    gc.collect()
    assert torch.equal(weights, torch.arange(1000.0))
    assert mirror.is_fresh()


def test_a_tracked_mirror_ignores_steps_of_optimizers_that_do_not_hold_its_tensor():
    from gpuflow import HostMirror

    table = torch.randn(4, 3)
    _, optimizer = _trained_param(fused=True)
    mirror = HostMirror(table, writes="tracked")
    mirror.numpy()
    optimizer.step()
    assert mirror.is_fresh()
    mirror.numpy()
    assert (mirror.stats.misses, mirror.stats.hits) == (1, 1)


def test_a_default_mirror_sees_writes_through_data():
    from gpuflow import HostMirror

    param = torch.nn.Parameter(torch.ones(4))
    mirror = HostMirror(param)
    mirror.numpy()
    param.data.mul_(3.0)  # no version bump, no optimizer: nothing PyTorch signals
    assert not mirror.is_fresh()  # it cannot know, so it does not claim to
    assert mirror.numpy().tolist() == [3.0] * 4
    assert mirror[2] == 3.0


def test_a_tracked_mirror_follows_storage_swaps():
    from gpuflow import HostMirror

    param = torch.nn.Parameter(torch.ones(4))
    mirror = HostMirror(param, writes="tracked")
    mirror.numpy()
    param.data = torch.full((2, 3), 5.0)  # a new tensor behind the same Parameter
    assert not mirror.is_fresh()
    assert mirror.numpy().tolist() == [[5.0] * 3] * 2
    with torch.no_grad():
        param.set_(torch.arange(3.0))
    assert not mirror.is_fresh()
    assert mirror.numpy().tolist() == [0.0, 1.0, 2.0]
    assert mirror[2] == 2.0


def test_a_tracked_mirror_follows_resize():
    from gpuflow import HostMirror

    buffer = torch.ones(4)
    mirror = HostMirror(buffer, writes="tracked")
    mirror.numpy()
    buffer.resize_(2, 4)
    buffer[1] = 2.0
    assert not mirror.is_fresh()
    assert mirror.numpy().tolist() == [[1.0] * 4, [2.0] * 4]
    param = torch.nn.Parameter(torch.ones(3))
    mirror = HostMirror(param, writes="tracked")
    mirror.numpy()
    param.data.resize_(1000)  # new memory under the same shape and version
    assert not mirror.is_fresh()


def test_mirror_refuses_an_unknown_writes_contract():
    from gpuflow import HostMirror

    with pytest.raises(ValueError, match="writes"):
        HostMirror(torch.ones(2), writes="never")


def test_async_scalars_take_one_name_as_a_string():
    from gpuflow import AsyncScalars

    scalars = AsyncScalars("loss", "cpu")
    assert scalars.names == ("loss",)
    scalars.add(loss=2.0)
    assert scalars.drain(1) == [(1, {"loss": 2.0})]


@pytest.mark.parametrize(
    ("names", "message"),
    [(["loss", "loss"], "more than once"), ([], "at least one"), (["loss", ""], "empty")],
)
def test_async_scalars_refuse_bad_names(names, message):
    from gpuflow import AsyncScalars

    with pytest.raises(ValueError, match=message):
        AsyncScalars(names, "cpu")
    with pytest.raises(TypeError, match="str"):
        AsyncScalars(["loss", 3], "cpu")


def test_a_tracked_mirror_of_an_inference_tensor_never_claims_fresh():
    from gpuflow import HostMirror

    with torch.inference_mode():
        table = torch.zeros(3)
    mirror = HostMirror(table, writes="tracked")
    mirror.numpy()
    with torch.inference_mode():
        table.add_(1)  # inference tensors keep no version counter
    assert not mirror.is_fresh()
    assert mirror.numpy().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("writes", ["unknown", "tracked"])
def test_an_indexed_read_keeps_the_values_it_read(writes):
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    mirror = HostMirror(layer.weight, writes=writes)
    row, block = mirror[0], mirror[0:2]  # stale reads: fetched (a cpu tensor's .cpu() aliases)
    saved_row, saved_block = row.copy(), block.copy()
    layer(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # every weight moves by -1
    np.testing.assert_array_equal(row, saved_row)
    np.testing.assert_array_equal(block, saved_block)
    assert not np.array_equal(mirror[0], saved_row)
    # Read from a fresh host copy, then the copy refreshed: the earlier read stays.
    mirror.numpy()
    fresh = mirror[1]
    kept = fresh.copy()
    with torch.no_grad():
        layer.weight.add_(5.0)
    mirror.refresh_async()
    mirror.numpy()
    np.testing.assert_array_equal(fresh, kept)
    assert not fresh.flags.writeable


@pytest.mark.parametrize(
    ("dtype", "wide"),
    [(torch.bfloat16, np.float32), (torch.float8_e4m3fn, np.float32),
     (torch.float8_e5m2, np.float32), (torch.complex32, np.complex64),
     (torch.float16, np.float16)],
)  # fmt: skip
def test_a_mirror_of_a_dtype_numpy_lacks_reads_it_widened(dtype, wide):
    """fp8 and complex32 failed in numpy's conversion, after the fetch was paid for."""
    values = torch.tensor([0.5, -2.0, 3.0]).to(dtype)
    mirror = HostMirror(values)
    assert mirror.numpy().dtype == wide
    assert mirror.numpy().tolist() == values.to(torch.complex64 if dtype.is_complex else
                                                torch.float32).tolist()  # fmt: skip
    assert mirror[1] == values[1].item()


@pytest.mark.parametrize("index", [slice(None, None, -1), (slice(None), slice(None, None, -2))])
def test_a_stale_read_with_a_negative_step_reads_as_a_fresh_one(index):
    """A fresh read gave numpy's reversed array; a stale one failed in torch's indexing."""
    values = torch.arange(12.0).reshape(3, 4)
    mirror = HostMirror(values)
    fresh = mirror[index]
    values.add_(1)
    mirror.mark_dirty()
    assert np.array_equal(mirror[index], fresh + 1)
