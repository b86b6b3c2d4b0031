"""pack/unpack: any nested batch, one buffer, the same structure back; codecs checked."""

from __future__ import annotations

import math
from collections import OrderedDict, deque, namedtuple
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.packing import ALIGN, Ragged, pack, plan_pack, rebuild, unpack

Pair = namedtuple("Pair", "left right")

_DTYPES = [np.int64, np.int32, np.int16, np.uint8, np.float32, np.float64, np.bool_]

arrays = st.sampled_from(_DTYPES).flatmap(
    lambda dt: hnp.arrays(
        dt,
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
        elements=(st.floats(-1e6, 1e6, width=32) if np.dtype(dt).kind == "f" else None),
    )
)
leaves = st.one_of(
    arrays,
    arrays.map(torch.from_numpy),
    st.lists(st.lists(st.integers(0, 2**40), max_size=6), min_size=1, max_size=5),
    st.sampled_from(["text", 3, 2.5, None]),
)
batches = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text("abcdef", min_size=1, max_size=3), children, max_size=4),
        st.tuples(children, children).map(lambda t: Pair(*t)),
    ),
    max_leaves=12,
)


def is_ragged(obj) -> bool:
    """The documented rule: integer lists (empty ones too) in a list or tuple that is not a
    namedtuple."""
    return (
        isinstance(obj, list | tuple)
        and not hasattr(obj, "_fields")
        and len(obj) > 0
        and all(isinstance(s, list | tuple) and all(type(v) is int for v in s) for s in obj)
    )


def assert_same(original, rebuilt):
    """``rebuilt`` is ``original`` with arrays as tensors of the original dtype and values."""
    if isinstance(original, np.ndarray):
        original = torch.from_numpy(original)
    if isinstance(original, torch.Tensor):
        assert isinstance(rebuilt, torch.Tensor)
        assert rebuilt.dtype == original.dtype and rebuilt.shape == original.shape
        assert torch.equal(rebuilt.cpu(), original)
    elif is_ragged(original):
        assert isinstance(rebuilt, Ragged)
        assert [rebuilt[i].tolist() for i in range(len(rebuilt))] == [list(s) for s in original]
    elif isinstance(original, dict):
        assert type(rebuilt) is type(original) and list(rebuilt) == list(original)
        for key in original:
            assert_same(original[key], rebuilt[key])
    elif isinstance(original, list | tuple):
        assert type(rebuilt) is type(original) and len(rebuilt) == len(original)
        for a, b in zip(original, rebuilt, strict=True):
            assert_same(a, b)
    else:
        assert rebuilt == original


@settings(max_examples=150, deadline=None)
@given(batch=batches, narrow=st.booleans())
def test_round_trip_of_any_nested_batch(batch, narrow):
    packed = pack(batch, narrow=narrow)
    assert_same(batch, unpack(packed, "cpu"))


@settings(max_examples=60, deadline=None)
@given(values=hnp.arrays(np.int64, st.integers(1, 200), elements=st.integers(-(2**62), 2**62)))
def test_narrowing_never_changes_a_value(values):
    packed = pack({"ids": values})
    out = unpack(packed, "cpu")["ids"]
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.from_numpy(values))


@pytest.mark.parametrize(
    ("values", "wire_bytes_per_item"),
    [([0, 65535], 2), ([-1, 5], 4), ([0, 2**31 - 1], 4), ([0, 2**31], 8), ([-(2**40), 0], 8)],
)
def test_narrowing_picks_the_narrowest_type_that_holds_every_value(values, wire_bytes_per_item):
    tensor = torch.tensor(values * 50, dtype=torch.int64)
    plan = plan_pack(tensor)
    assert plan.nbytes == -(-len(values) * 50 * wire_bytes_per_item // ALIGN) * ALIGN
    assert torch.equal(unpack(pack(tensor), "cpu"), tensor)


@pytest.mark.parametrize(
    ("tensor", "wire_bytes_per_item"),
    [
        (torch.arange(2**20 + 1) % 65536, 2),  # past the one-pass check's size: aminmax
        (torch.arange(2**20 + 1) % 65536 - 1, 4),  # the same with a negative value
        (torch.tensor([0, 70000] * 50, dtype=torch.int32), 4),  # int32 stays as it is
        (torch.tensor([3, 5] * 50, dtype=torch.int32), 2),
        (torch.tensor([[0, 2**31 - 1]] * 50).t(), 4),  # strided: aminmax
    ],
    ids=["large", "large-negative", "int32", "int32-small", "strided"],
)
def test_narrowing_decides_alike_whichever_check_settles_it(tensor, wire_bytes_per_item):
    plan = plan_pack(tensor)
    assert plan.nbytes == -(-tensor.numel() * wire_bytes_per_item // ALIGN) * ALIGN
    assert torch.equal(unpack(pack(tensor), "cpu"), tensor)


def test_narrowing_can_be_turned_off():
    ids = torch.arange(1000)
    assert plan_pack(ids).nbytes == 2000
    assert plan_pack(ids, narrow=False).nbytes == 8000


@pytest.mark.parametrize(("codec", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_lossy_floats_halve_the_bytes_and_come_back_as_float32(codec, dtype):
    x = torch.randn(4096)
    packed = pack({"x": x, "ids": torch.arange(8)}, lossy_float=codec)
    assert packed.nbytes < packed.logical_nbytes / 1.9
    out = unpack(packed, "cpu")["x"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.to(dtype).float(), rtol=0, atol=0)
    assert (out - x).abs().max() <= x.abs().max() * 2**-7  # bf16 keeps 8 bits of mantissa


def test_fp16_refuses_values_it_would_turn_into_inf():
    with pytest.raises(GpuflowError, match="beyond fp16's range"):
        pack(torch.tensor([1.0, 1e6]), lossy_float="fp16")
    pack(torch.tensor([1.0, 1e6]), lossy_float="bf16")


@pytest.mark.parametrize(("codec", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_values_past_a_codecs_largest_refused_only_where_they_round_to_inf(codec, dtype):
    """Within half a step of the largest value a codec holds, a value rounds down to it."""
    finfo = torch.finfo(dtype)
    largest = finfo.max
    step = 2.0 ** math.floor(math.log2(largest)) * finfo.eps  # between the two largest values
    rounds_down = torch.tensor([largest + step / 4, -largest - step / 4])  # float32
    assert (rounds_down.abs() > largest).all()
    out = unpack(pack(rounds_down, lossy_float=codec), "cpu")
    assert out.tolist() == [largest, -largest]
    with pytest.raises(GpuflowError, match=r"holds -[0-9.e+]+, beyond"):  # its sign said
        pack(torch.tensor([1.0, -largest * 1.01], dtype=torch.float64), lossy_float=codec)


def test_unknown_codec_is_refused():
    with pytest.raises(GpuflowError, match="lossy_float must be one of"):
        pack(torch.zeros(3), lossy_float="fp8")


def test_uint8_and_bool_cross_as_they_are():
    image = np.random.default_rng(0).integers(0, 256, (3, 32, 32), dtype=np.uint8)
    mask = torch.rand(3, 32) > 0.5
    packed = pack({"image": image, "mask": mask}, lossy_float="bf16")
    assert packed.nbytes == packed.logical_nbytes
    out = unpack(packed, "cpu")
    assert out["image"].dtype == torch.uint8 and torch.equal(out["image"], torch.from_numpy(image))
    assert torch.equal(out["mask"], mask)


def test_unchanged_tensors_are_views_of_the_one_buffer():
    batch = {"a": torch.randn(10), "b": [torch.ones(3, 3, dtype=torch.float64), torch.arange(5.0)]}
    packed = pack(batch)
    out = rebuild(packed.buffer, packed.spec)
    base = packed.buffer.untyped_storage().data_ptr()
    for t in (out["a"], *out["b"]):
        assert t.untyped_storage().data_ptr() == base
        assert (t.data_ptr() - base) % ALIGN == 0


def test_ragged_sequences_pack_as_values_and_offsets():
    seqs = [[5, 6, 7], [], [8], [9, 10]]
    out = unpack(pack({"tokens": seqs}), "cpu")["tokens"]
    assert isinstance(out, Ragged)
    assert out.lengths() == [3, 0, 1, 2]
    assert out.values.tolist() == [5, 6, 7, 8, 9, 10] and out.offsets.tolist() == [0, 3, 3, 4, 6]
    assert out[3].tolist() == [9, 10]


def test_mappings_keep_their_type_and_order():
    batch = OrderedDict([("z", torch.zeros(1)), ("a", torch.ones(1))])
    out = unpack(pack(batch), "cpu")
    assert type(out) is OrderedDict and list(out) == ["z", "a"]


def test_write_into_refuses_a_small_buffer():
    plan = plan_pack(torch.zeros(100))
    with pytest.raises(ValueError, match="400 bytes"):
        plan.write_into(torch.empty(10, dtype=torch.uint8))


def test_public_names_resolve():
    import gpuflow

    for name in (
        "Device",
        "PinnedPool",
        "pack",
        "unpack",
        "DeviceLoader",
        "HostMirror",
        "AsyncScalars",
        "StateSnapshot",
        "Ragged",
        "GpuflowError",
    ):
        assert getattr(gpuflow, name).__name__ == name
    with pytest.raises(AttributeError):
        gpuflow.NotAThing  # noqa: B018


# ---- what users pass ------------------------------------------------------------------------


def test_a_dataclass_batch_crosses_field_by_field():
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        images: torch.Tensor
        labels: torch.Tensor
        name: str = "train"

    batch = Batch(torch.ones(2, 3, dtype=torch.uint8), torch.tensor([1, 7]))
    out = unpack(pack(batch), "cpu")
    assert isinstance(out, Batch) and out.name == "train"
    assert out.images.tolist() == batch.images.tolist() and out.labels.tolist() == [1, 7]
    assert out.labels.dtype == torch.int64


def _nested() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # torch calls its nested tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


def test_what_cannot_be_packed_is_refused_not_left_on_the_host():
    class Moves:
        def to(self, device):
            return self

    for batch, match in [
        ({"x": Moves()}, "has .to\\(\\)"),
        ({"x": torch.eye(3).to_sparse()}, "sparse_coo tensor cannot be packed"),
        ({"x": _nested()}, "nested"),
        ({"x": torch.ones(3, device="meta")}, "a meta tensor holds no data to move"),
        ({"x": deque([torch.ones(3)])}, "a deque in the batch holds tensors"),
        ({"x": {torch.ones(3)}}, "a set in the batch holds tensors"),
        ([SimpleNamespace(x=np.ones(3))], "a SimpleNamespace in the batch holds"),
        ((SimpleNamespace(inner=SimpleNamespace(x=torch.ones(3))),), "SimpleNamespace"),
    ]:
        with pytest.raises(GpuflowError, match=match):
            pack(batch)
    # what holds no data still crosses as it is
    kept = unpack(pack({"x": torch.ones(2), "tags": {"a"}, "meta": SimpleNamespace(n=3)}), "cpu")
    assert kept["tags"] == {"a"} and kept["meta"].n == 3


def test_an_unpacked_batch_is_its_own_when_the_buffer_is_used_again():
    # On the cpu the copy lands on the buffer's own device: the batch must not be the buffer.
    buffer = torch.empty(1024, dtype=torch.uint8)
    batches = [unpack(pack({"x": torch.full((4,), float(i))}, out=buffer), "cpu") for i in range(3)]
    assert [b["x"].tolist() for b in batches] == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def test_sequences_that_are_all_empty_are_still_ragged():
    some = unpack(pack({"ids": [[1, 2], []]}), "cpu")["ids"]
    none = unpack(pack({"ids": [[], []]}), "cpu")["ids"]
    assert isinstance(some, Ragged) and isinstance(none, Ragged)
    assert none.lengths() == [0, 0] and some.lengths() == [2, 0]


def test_ragged_ids_past_int64_are_refused_in_words_and_its_ends_kept():
    for beyond in (2**63, -(2**63) - 1):
        with pytest.raises(GpuflowError, match="outside int64's range"):
            pack({"ids": [[1, 2], [beyond]]})
    ends = [[2**63 - 1], [-(2**63)]]
    assert unpack(pack({"ids": ends}), "cpu")["ids"].values.tolist() == [2**63 - 1, -(2**63)]


def test_the_fp16_range_check_sees_past_an_inf_already_there():
    with pytest.raises(GpuflowError, match="beyond fp16's range"):
        pack({"x": torch.tensor([float("inf"), 70000.0])}, lossy_float="fp16")
    out = unpack(
        pack({"x": torch.tensor([float("inf"), float("nan"), 1.5])}, lossy_float="fp16"), "cpu"
    )
    assert out["x"][0].item() == float("inf") and out["x"][2].item() == 1.5


def test_lossy_codecs_chosen_per_key():
    batch = {"features": torch.full((4,), 1 / 3), "targets": torch.full((4,), 1 / 3)}
    packed = pack(batch, lossy_float={"features": "bf16"})
    out = unpack(packed, "cpu")
    assert out["targets"].tolist() == batch["targets"].tolist()  # exact: no codec named
    assert out["features"].tolist() != batch["features"].tolist()  # through bf16
    assert out["features"].dtype == torch.float32
    with pytest.raises(GpuflowError, match="'feature', which the batch does not have"):
        pack(batch, lossy_float={"feature": "bf16"})
    with pytest.raises(GpuflowError, match="one of"):
        pack(batch, lossy_float={"features": "fp8"})
