"""The driver's host-to-device copy: found once where libcuda loads, None where it does not
(the copy itself: test_drivercopy_gpu.py)."""

from __future__ import annotations

import ctypes

from gpuflow.device import drivercopy
from gpuflow.device.drivercopy import driver_copy


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_the_copy_is_there_exactly_where_the_driver_is_and_looked_up_once():
    copy = driver_copy()
    assert (copy is not None) == _libcuda_loads()
    assert driver_copy() is copy  # cached: one lookup per process
    if copy is not None:
        assert copy.restype is ctypes.c_int and len(copy.argtypes) == 4


def test_a_machine_without_the_driver_gets_none(monkeypatch):
    def no_driver(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    driver_copy.cache_clear()
    monkeypatch.setattr(drivercopy.ctypes, "CDLL", no_driver)
    monkeypatch.setattr(drivercopy.ctypes, "PyDLL", no_driver)
    try:
        assert driver_copy() is None
    finally:
        driver_copy.cache_clear()  # the next caller looks the real driver up again
