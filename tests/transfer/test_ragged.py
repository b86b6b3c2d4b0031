"""Ragged's indexing: sequence i, counted from the end when negative, and slices."""

from __future__ import annotations

import pytest
import torch

from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import Ragged

SEQUENCES = [[1, 2], [], [3, 4, 5]]


def test_negative_indices_count_from_the_end_as_a_list_does():
    ragged = Ragged.from_sequences(SEQUENCES)
    for i in range(-3, 3):
        assert ragged[i].tolist() == SEQUENCES[i]
    assert [s.tolist() for s in ragged] == SEQUENCES


@pytest.mark.parametrize("index", [3, -4, 10])
def test_an_index_past_either_end_is_refused(index):
    with pytest.raises(IndexError, match=f"sequence {index} of a Ragged of 3"):
        Ragged.from_sequences(SEQUENCES)[index]


@pytest.mark.parametrize("cut", [slice(0, 2), slice(1, None), slice(-1, None), slice(2, 1),
                                 slice(None), slice(5, 9)])  # fmt: skip
def test_a_slice_is_a_ragged_of_those_sequences(cut):
    ragged = Ragged.from_sequences(SEQUENCES)
    part = ragged[cut]
    assert isinstance(part, Ragged)
    assert [s.tolist() for s in part] == SEQUENCES[cut]
    assert part.lengths() == [len(s) for s in SEQUENCES[cut]]
    assert part.offsets.tolist() == list(part.host_offsets)


def test_a_slice_with_a_step_is_refused_in_words():
    with pytest.raises(ValueError, match="sequences in a row, not step 2"):
        Ragged.from_sequences(SEQUENCES)[::2]


def test_a_ragged_that_crossed_indexes_from_the_end_too():
    batch = {"ids": Ragged.from_sequences(SEQUENCES), "x": torch.ones(2)}
    (got,) = list(DeviceLoader([batch], "cpu"))
    assert got["ids"][-1].tolist() == [3, 4, 5]
    assert [s.tolist() for s in got["ids"][1:]] == SEQUENCES[1:]
