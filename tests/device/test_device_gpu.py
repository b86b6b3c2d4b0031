"""The link probe on a real accelerator."""

from __future__ import annotations

import pytest

from gpuflow.device.linkprobe import probe_link

pytestmark = pytest.mark.gpu


def test_link_probe_measures_every_copy_kind(accel):
    rates = probe_link(accel, nbytes=16 << 20, repeats=3)
    assert set(rates) == {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "d2d"}
    assert all(r > 0.1 for r in rates.values())
    if accel.type == "cuda":
        assert rates["h2d_pinned"] > rates["h2d_pageable"] * 0.9
        assert rates["d2d"] > rates["h2d_pinned"]
