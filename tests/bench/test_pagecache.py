"""The operating system's page cache for one file (``gpuflow.bench.pagecache``), which the io
bench uses for its cold reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuflow.bench import pagecache


def test_the_page_cache_share_of_a_file(tmp_path):
    path = tmp_path / "pages"
    path.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    path.read_bytes()
    if pagecache.cached_fraction(path) is None:
        pytest.skip("mincore is Linux's")
    assert pagecache.cached_fraction(path) == 1.0  # just read
    assert pagecache.drop_cached(path)
    if _filesystem_of(path) in ("tmpfs", "ramfs"):  # nothing else to keep the pages in
        assert pagecache.cached_fraction(path) == 1.0
    else:  # flushed, then dropped: a cold read from here on
        assert pagecache.cached_fraction(path) <= 0.05
    assert np.frombuffer(path.read_bytes(), dtype=np.uint8).size == 1 << 20  # still whole


def _filesystem_of(path):
    """The type of the filesystem ``path`` lies on (the mount with the longest matching
    mount point in /proc/self/mounts)."""
    best, kind = "", ""
    resolved = str(path.resolve())
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind
