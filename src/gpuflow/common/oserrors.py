"""Faults of the machine (a full disk, a read-only folder, a name too long) as one line that
names the path and says what to do."""

from __future__ import annotations

import errno

_ADVICE = {
    errno.ENOSPC: "free disk space there, or choose another place",
    errno.EDQUOT: "your disk quota is used up: free space, or choose another place",
    errno.EROFS: "the file system is read-only: choose a writable place",
    errno.EACCES: "you may not write there: fix its permissions, or choose another place",
    errno.EPERM: "the operation is not permitted there: choose another place",
    errno.ENAMETOOLONG: "the name is too long for the file system: choose a shorter one",
    errno.EBUSY: "something else holds it: close that, then try again",
    errno.ETXTBSY: "something else holds it: close that, then try again",
    errno.ENOTDIR: "a file stands where a folder should be: move it away",
    errno.EEXIST: "something of that name is already there: move it away, or choose another name",
    errno.EISDIR: "a folder stands where a file should be: move it away",
    errno.EMFILE: "too many files are open: raise the limit (ulimit -n)",
    errno.EIO: "the disk reported an input/output error: check it",
}


def describe_os_error(exc: OSError) -> str:
    """``exc`` as one line: what failed, on which path, and what to do."""
    where = f" ({exc.filename})" if exc.filename else ""
    what = exc.strerror or str(exc) or type(exc).__name__
    advice = _ADVICE.get(exc.errno or -1, "check the path and try again")
    return f"{what}{where}; {advice}"
