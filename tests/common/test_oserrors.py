"""A fault of the machine as one line: what failed, on which path, and what to do."""

from __future__ import annotations

import errno

import pytest

from gpuflow.common.oserrors import describe_os_error


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "free disk space there, or choose another place"),
        (errno.EROFS, "the file system is read-only: choose a writable place"),
        (errno.EACCES, "you may not write there: fix its permissions, or choose another place"),
        (errno.ENAMETOOLONG, "the name is too long for the file system: choose a shorter one"),
        (errno.ENOTDIR, "a file stands where a folder should be: move it away"),
        (errno.EMFILE, "too many files are open: raise the limit (ulimit -n)"),
    ],
)
def test_each_fault_names_its_path_and_what_to_do(code, advice):
    line = describe_os_error(OSError(code, "what the system says", "/data/out/meta.json"))
    assert line == f"what the system says (/data/out/meta.json); {advice}"
    assert "\n" not in line


def test_a_fault_without_a_path_or_known_errno_still_says_what_to_do():
    assert describe_os_error(OSError(errno.ENOSPC, "No space left on device")) == (
        "No space left on device; free disk space there, or choose another place"
    )
    unknown = describe_os_error(OSError(errno.ECONNRESET, "Connection reset", "/socket"))
    assert unknown == "Connection reset (/socket); check the path and try again"


def test_an_error_with_no_strerror_is_described_by_its_text_or_its_type():
    assert describe_os_error(OSError("the disk went away")) == (
        "the disk went away; check the path and try again"
    )
    assert describe_os_error(FileNotFoundError()) == (
        "FileNotFoundError; check the path and try again"
    )


def test_a_real_fault_reads_as_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError) as caught:
        (blocker / "inside.txt").write_text("x")  # a file where a folder should be
    line = describe_os_error(caught.value)
    assert line.startswith("Not a directory (") and str(blocker / "inside.txt") in line
    assert line.endswith("a file stands where a folder should be: move it away")
