"""Shared by the loader phase probes: host seconds spent in each wrapped function."""

import time
from collections import defaultdict

T = defaultdict(float)  # phase name -> seconds


def timed(name, fn):
    """``fn`` wrapped so that its calls add their host time to ``T[name]``."""

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t0

    return wrapper
