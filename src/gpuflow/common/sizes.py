"""Size arithmetic shared by every layer."""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple
