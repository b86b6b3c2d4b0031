"""File bytes into device memory: through kvikio, or through gpuflow's own pinned buffers.

``data.io`` picks how the resident corpus is read from its shards: ``kvikio``, ``pinned``
(``HostFileReader``) or ``auto``.

    choice = choose_io("auto", device)          # IoChoice("kvikio", "compat", "...")
    reader = KvikioReader(device)
    reader.read(path, file_offset, target)      # target: contiguous device tensor, filled

What each path does, and how kvikio's reads are counted (``disk2d``):
docs/architecture/crossings.md (File bytes into device memory).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.accounting.tally import report_copy
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

IO_PATHS = ("auto", "kvikio", "pinned")
# cuFile moves whole 4 KiB pages without a bounce: requests past the first start on one.
FILE_ALIGN = 4096
# Reading page-cached bytes is a copy made by the kernel on the reading thread, so one
# thread reads at one core's memcpy speed and eight read several times faster
# (docs/decisions/016). Both readers use this many unless told otherwise (KVIKIO_NTHREADS
# for kvikio).
READ_THREADS = min(8, os.cpu_count() or 1)
_READ_PART = 8 << 20  # bytes one thread reads at a time


@dataclass(frozen=True)
class IoChoice:
    """How the corpus is read: ``path`` kvikio or pinned; ``mode`` gds or compat for kvikio;
    ``reason`` the sentence the run prints."""

    path: str
    mode: str | None
    reason: str

    def describe(self) -> str:
        label = self.path if self.mode is None else f"{self.path} ({self.mode})"
        return f"data.io {label}: {self.reason}"


def install_hint() -> str:
    """The extra that brings kvikio for the CUDA torch was built with."""
    cuda = torch.version.cuda or ""
    extra = "gds-cu12" if cuda.startswith("12") else "gds"
    return f"pip install 'gpuflow[{extra}]' (kvikio for CUDA {cuda or '12 or 13'})"


def _load_kvikio() -> Any:
    try:
        import kvikio
        import kvikio.defaults
    except (ImportError, OSError):  # OSError: libkvikio or libcufile failed to load
        return None
    return kvikio


def _import_kvikio() -> Any:
    """kvikio, reading on ``READ_THREADS`` threads unless KVIKIO_NTHREADS says otherwise; or
    None when it is not installed or cannot load its library here."""
    kvikio = _load_kvikio()
    if kvikio is not None and "KVIKIO_NTHREADS" not in os.environ:
        kvikio.defaults.set("num_threads", READ_THREADS)
    return kvikio


def kvikio_mode() -> str | None:
    """``gds`` when kvikio reads through GPUDirect Storage, ``compat`` when through its
    POSIX fallback, None when kvikio is not available."""
    kvikio = _import_kvikio()
    if kvikio is None:
        return None
    return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"


def choose_io(requested: str, device: Device, managed: bool = False) -> IoChoice:
    """The reader ``data.io = requested`` gets on ``device``. An explicit ``kvikio`` that
    cannot run here is refused with what to do; ``auto`` falls back to ``pinned``."""
    if requested not in IO_PATHS:
        raise GpuflowError(f"data.io must be one of {', '.join(IO_PATHS)}, got {requested!r}")
    if requested == "pinned":
        return IoChoice("pinned", None, "as configured")
    why_not = None
    if device.type != "cuda":
        why_not = f"kvikio reads into CUDA memory, and the device is {device}"
    elif managed:
        why_not = "the corpus is in managed memory (data.placement=managed), read through pinned"
    mode = kvikio_mode() if why_not is None else None
    if why_not is None and mode is None:
        why_not = f"kvikio is not installed: {install_hint()}"
    if why_not is not None:
        if requested == "kvikio":
            raise GpuflowError(f"data.io=kvikio cannot run: {why_not}; or set data.io=pinned")
        return IoChoice("pinned", None, why_not)
    if mode == "gds":
        return IoChoice("kvikio", mode, "GPUDirect Storage: the files go to device memory")
    threads = _import_kvikio().defaults.get("num_threads")
    return IoChoice(
        "kvikio", mode,
        f"no GPUDirect Storage here: POSIX reads on {threads} thread(s) into its own bounce "
        "buffers (`gpuflow bench io` compares it with the pinned path on this machine)",
    )  # fmt: skip


class KvikioReader:
    """Reads byte ranges of files into device tensors through kvikio."""

    def __init__(self, device: Device) -> None:
        self.kvikio = _import_kvikio()
        if self.kvikio is None:
            raise GpuflowError(f"kvikio is not installed: {install_hint()}")
        self.device = device
        self._files: dict[Path, Any] = {}  # open handles: a cuFile handle is costly to open

    def read(self, path: Path, file_offset: int, target: torch.Tensor) -> None:
        """Fill ``target`` (contiguous; device memory, or host memory, which kvikio reads
        into too) with ``target.nbytes`` bytes of ``path`` from ``file_offset``; returns once
        they are in place."""
        if not target.is_contiguous():
            raise GpuflowError("KvikioReader.read fills a contiguous tensor")
        nbytes = target.nbytes
        flat = target.view(torch.uint8) if nbytes else target  # (nbytes,)
        handle = self._open(path)
        # A short first request up to a page boundary, then page-aligned file offsets.
        head = min(nbytes, -file_offset % FILE_ALIGN)
        futures = []
        for lo, hi in ((0, head), (head, nbytes)):
            if hi > lo:
                futures.append(handle.pread(flat[lo:hi], hi - lo, file_offset + lo))
        got = sum(f.get() for f in futures)
        if got != nbytes:
            raise _short_read(path, got, nbytes, file_offset)
        report_copy("disk2d", nbytes, "kvikio pread", str(target.dtype).removeprefix("torch."))

    def _open(self, path: Path) -> Any:
        path = Path(path)
        if path not in self._files:
            self._files[path] = self.kvikio.CuFile(os.fspath(path), "r")
        return self._files[path]

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class HostFileReader:
    """Reads byte ranges of files into host buffers (pinned ones, for the ``pinned`` path) on
    ``threads`` threads at once; see ``READ_THREADS``."""

    def __init__(self, threads: int = READ_THREADS) -> None:
        self._n_threads = max(1, threads)
        self._threads = ThreadPoolExecutor(self._n_threads, thread_name_prefix="gpuflow-read")
        self._files: dict[Path, int] = {}
        # A reader dropped without close() (its owner collected) closes its files then.
        self._close_files = weakref.finalize(self, _close_all, self._files)

    def read(self, path: Path, file_offset: int, out: Any) -> None:
        """Fill ``out`` (a writable buffer of bytes: a uint8 array) from ``file_offset``."""
        self.read_many([(path, file_offset, out)])

    def read_many(self, requests: Iterable[tuple[Path, int, Any]]) -> None:
        """Fill each ``out`` of ``requests`` (path, file offset, out) as ``read`` does. Their
        parts are shared among the threads in runs of about equal bytes, so a chunk of many
        short reads costs a few hand-offs to the threads, not one per read."""
        wanted: list[tuple[Path, int, int]] = []
        parts = []  # (request, fd, bytes to fill, file offset)
        for path, file_offset, out in requests:
            view = memoryview(out).cast("B")
            fd = self._open(path)
            parts += [
                (len(wanted), fd, view[lo : lo + _READ_PART], file_offset + lo)
                for lo in range(0, len(view), _READ_PART)
            ]
            wanted.append((path, file_offset, len(view)))
        share = max(1, -(-sum(len(part[2]) for part in parts) // self._n_threads))
        runs, run, size = [], [], 0
        for part in parts:
            run.append(part)
            size += len(part[2])
            if size >= share:
                runs.append(run)
                run, size = [], 0
        if run:
            runs.append(run)
        got = [0] * len(wanted)
        for future in [self._threads.submit(_read_run, run) for run in runs]:
            for request, n in future.result():
                got[request] += n
        for (path, file_offset, n), read in zip(wanted, got, strict=True):
            if read != n:
                raise _short_read(path, read, n, file_offset)

    def _open(self, path: Path) -> int:
        path = path if isinstance(path, Path) else Path(path)  # a chunk's reads: many a turn
        if path not in self._files:
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._close_files()


def _close_all(files: dict[Path, int]) -> None:
    for fd in files.values():
        os.close(fd)
    files.clear()


def _short_read(path: Path, got: int, wanted: int, offset: int) -> GpuflowError:
    return GpuflowError(
        f"{path} gave {got} of {wanted} bytes from offset {offset}: the file is shorter than "
        "its header says; prepare the data again"
    )


def _read_run(run: list[tuple[int, int, memoryview, int]]) -> list[tuple[int, int]]:
    """(request, bytes read) for each (request, fd, out, offset) of ``run``, read in turn."""
    return [(request, _read_fully(fd, out, offset)) for request, fd, out, offset in run]


def _read_fully(fd: int, out: memoryview, offset: int) -> int:
    """Bytes read into ``out`` from ``offset``: all of them, or fewer at the end of the file."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
