"""Size arithmetic: rounding up to a multiple."""

from __future__ import annotations

import pytest

from gpuflow.common.sizes import round_up


@pytest.mark.parametrize(
    ("n", "multiple", "expected"),
    [(0, 64, 0), (1, 64, 64), (63, 64, 64), (64, 64, 64), (65, 64, 128), (7, 1, 7), (10, 4, 12)],
)
def test_round_up_gives_the_least_multiple_not_below_n(n, multiple, expected):
    assert round_up(n, multiple) == expected


def test_round_up_is_exact_for_sizes_past_float_precision():
    n = (1 << 60) + 1
    assert round_up(n, 4096) == (1 << 60) + 4096
