"""Which frame an event is charged to: the caller outside torch and gpuflow's layers, and
whether a read of host data stands for a wait on a GPU or happens under the compiler."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from gpuflow.common.layers import LOOKED_THROUGH

_TORCH_DIR = str(Path(torch.__file__).parent)
_PACKAGE = Path(__file__).parents[2]  # src/gpuflow
_ACCOUNTING = _PACKAGE / "accounting"
# The layers that carry a crossing out (gpuflow.common.layers): their frames are skipped when
# locating an event, so that training code, the CLI and user code count as the caller.
_INTERNAL = tuple(str(_PACKAGE / layer) + os.sep for layer in LOOKED_THROUGH)
# (torch's folder with its separator: torchvision, torchmetrics and the like are callers)
_SKIPPED = (_TORCH_DIR + os.sep, f"{os.sep}contextlib.py", "<frozen ")


def _shorter(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative


def caller_location() -> str:
    """``file:line`` of the innermost frame outside torch and gpuflow's transfer layer."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_INTERNAL) and not any(s in name for s in _SKIPPED):
            return f"{_shorter(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


# Frames that only carry a read to its cause (the dispatch machinery, torch.compile's
# wrappers, Tensor's Python methods, the accounting layer's own files); and
# frames whose reads are of host data on a GPU machine too: an optimizer's step counters, a
# DataLoader's batches, compilation, gpuflow's transfer layer and its host buffers. A host
# read made straight from a frame of the second kind is not one that would wait for a GPU.
_DISPATCH_FILES = (
    "utils/_python_dispatch.py", "_ops.py", "_tensor.py", "overrides.py", "_compile.py",
    "_dynamo/eval_frame.py",
)  # fmt: skip
_HOST_SIDE_DIRS = ("optim", "utils/data", "_dynamo", "_inductor", "fx", "_functorch", "_subclasses")
_PLUMBING = (
    *(str(Path(_TORCH_DIR, *part.split("/"))) for part in _DISPATCH_FILES),
    str(_ACCOUNTING) + os.sep,
    f"{os.sep}contextlib.py",
    "<frozen ",
)
_HOST_SIDE = (
    *_INTERNAL,
    *(str(Path(_TORCH_DIR, *part.split("/"))) + os.sep for part in _HOST_SIDE_DIRS),
)


# Frames of torch.compile at work (tracing, code generation, autotuning): what runs under them
# is the compiler's, not the region's. The code it makes runs without them, and is counted.
_COMPILER_FILES = frozenset(
    str(Path(_TORCH_DIR, *part.split("/")))
    for part in ("_dynamo/convert_frame.py", "_inductor/compile_fx.py")
)


def _inside_the_compiler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _COMPILER_FILES:
            return True
        frame = frame.f_back
    return False


def _reads_device_data() -> bool:
    """Whether a read of host tensor data, made now, stands for a read of device data: the
    code that makes it is not one that reads host data on a GPU machine too."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    return frame is None or not frame.f_code.co_filename.startswith(_HOST_SIDE)
