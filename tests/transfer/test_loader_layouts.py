"""DeviceLoader on the cpu path: what arrives is what `.to()` would give (layouts, containers,
strides, dtypes, keys), and what cannot cross is refused in words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

# ---- what arrives is what .to() would give -------------------------------------------------


def test_layouts_and_container_types_arrive_as_to_keeps_them():
    from collections import defaultdict

    images = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    matrix = torch.randn(6, 5).t()  # a transpose: strides (1, 5)
    batch = defaultdict(list, {"images": images, "matrix": matrix})
    for got in DeviceLoader([batch, batch], "cpu"):
        assert isinstance(got, defaultdict) and got.default_factory is list
        assert got["images"].is_contiguous(memory_format=torch.channels_last)
        assert got["images"].stride() == images.to("cpu", copy=True).stride()
        assert got["matrix"].stride() == matrix.stride()
        assert torch.equal(got["images"], images) and torch.equal(got["matrix"], matrix)


def test_a_list_of_same_shape_tensors_keeps_their_strides():
    # A pair of channels_last image batches (a siamese pair): the same shape and dtype.
    a = torch.randn(8, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    b = torch.randn(8, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    plain = [torch.randn(8, 4), torch.randn(8, 4)]  # contiguous ones are still stacked
    with DeviceLoader([((a, b), plain)] * 2, "cpu") as loader:
        for (x, y), (p, q) in loader:
            for got, want in ((x, a), (y, b)):
                assert got.is_contiguous(memory_format=torch.channels_last)
                assert got.stride() == want.to("cpu", copy=True).stride()
                assert torch.equal(got, want)
            assert torch.equal(p, plain[0]) and torch.equal(q, plain[1])


def test_bad_depths_and_budget_limits_are_refused():
    from gpuflow.accounting.budgets import Budget

    for depth in (1.5, True, -1, "2"):
        with pytest.raises(GpuflowError, match="depth must be a whole number"):
            DeviceLoader([torch.ones(2)], "cpu", depth=depth)
    with pytest.raises(GpuflowError, match="syncs must be a whole number"):
        Budget(syncs=True)


def test_finite_floats_beyond_the_lossy_codecs_range_are_refused_not_sent_as_inf():
    big = torch.tensor([1.0, 1e300], dtype=torch.float64)
    with pytest.raises(GpuflowError, match="beyond bf16's range"):
        next(DeviceLoader([big], "cpu", lossy_float="bf16"))
    inf = torch.tensor([1.0, float("inf"), float("nan")], dtype=torch.float64)
    got = next(DeviceLoader([inf], "cpu", lossy_float="bf16"))  # already not finite: as is
    assert got[1].isinf() and got[2].isnan()


def test_a_device_given_as_an_int_is_an_accelerator_index_as_in_torch():
    if Device.resolve("auto").type != "cpu":
        pytest.skip("an accelerator is here (tests/transfer/test_loader_sources_gpu.py takes it)")
    with pytest.raises(GpuflowError, match="no accelerator"):
        DeviceLoader([torch.zeros(2)], 0)
    assert Device.resolve("cpu").type == "cpu"


def test_what_cannot_be_moved_or_copied_is_refused_in_words():
    import copy
    import pickle

    from gpuflow.transfer.packing import unpack

    with DeviceLoader([torch.ones(2)], "cpu") as loader:
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(GpuflowError, match="cannot be copied or pickled"):
                attempt(loader)
    cases = {
        "other byte order": np.arange(4, dtype=">i4"),
        "only numbers can": np.array(["a", "b"], dtype=object),
    }
    for match, array in cases.items():
        with pytest.raises(GpuflowError, match=match):
            list(DeviceLoader([array], "cpu"))
    with pytest.raises(GpuflowError, match="unpack takes what pack"):
        unpack(torch.ones(3), "cpu")


@pytest.mark.parametrize(
    "make",
    [lambda t: (t, t + 1), lambda t: {k: t * i for i, k in enumerate("abcd")}, lambda t: t,
     lambda t: [t.repeat(1000, 1), t.repeat(1000, 1) * 2]],
    ids=["stacked-pair", "dict-run", "lone", "large"],
)  # fmt: skip
def test_tensors_that_require_grad_cross_as_their_values(make):
    """Two or more such tensors in a list, or four in a dict, failed inside torch (stacked
    with out=, which autograd refuses); one crossed detached: every one now does."""
    noisy = torch.randn(8, 16, requires_grad=True)
    batch = make(noisy)
    with DeviceLoader([batch] * 3, "cpu") as loader:  # the first planned, the others alike
        *_, got = list(loader)

    def tensors(batch):
        if isinstance(batch, dict):
            return list(batch.values())
        return list(batch) if isinstance(batch, list | tuple) else [batch]

    for s, r in zip(tensors(batch), tensors(got), strict=True):
        assert not r.requires_grad and torch.equal(r, s.detach())


def test_dict_keys_that_are_equal_but_of_other_types_come_back_as_given():
    batches = [{1: torch.ones(2)}, {True: torch.ones(2)}, {1.0: torch.ones(2)}]
    with DeviceLoader(batches, "cpu") as loader:
        got = [type(next(iter(batch))) for batch in loader]
    assert got == [int, bool, float]


@pytest.mark.parametrize("coalesce", [True, False])
def test_sequences_all_empty_cross_as_ragged_in_every_epoch(coalesce):
    """A layout made once is used again for a batch like it: one of sequences that are all
    empty took that path with none of the ragged's tensors, the second time it came."""
    batches = [{"ids": [[], []], "label": torch.tensor([0, 1])}, {"ids": [[]]}, {"ids": [[]]}]
    with DeviceLoader(batches, "cpu", coalesce=coalesce) as loader:
        for _ in range(2):
            got = list(loader)
            assert [b["ids"].lengths() for b in got] == [[0, 0], [0], [0]]
            assert got[0]["label"].tolist() == [0, 1]


def test_a_device_this_machine_lacks_is_refused_in_a_library_users_words(monkeypatch):
    from gpuflow.device import accelerator

    monkeypatch.setattr(accelerator, "_backend_available", lambda device_type: False)
    with pytest.raises(GpuflowError, match=r"or use the cpu \('cpu', or --device cpu on the"):
        DeviceLoader([torch.ones(3)], "cuda")
