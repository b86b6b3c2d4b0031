"""Which CUDA allocator backs torch's device memory: ``train.allocator``.

- ``auto`` (the default): whichever ``PYTORCH_CUDA_ALLOC_CONF`` selects, else ``native``;
- ``native``: torch's caching allocator over ``cudaMalloc``;
- ``cudaMallocAsync``: CUDA's stream-ordered allocator and its memory pool;
- ``expandable``: the caching allocator with expandable segments (virtual memory that
  grows in place rather than a new ``cudaMalloc`` per segment).

torch reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when it loads, and refuses a backend set after
that (an internal assertion at CUDA's start, torch 2.11). So ``gpuflow train`` and ``gpuflow
bench train`` resolve the run's config first and, when the allocator in effect is not the
one asked for, start themselves again in the same process (``exec``) with the variable set,
before any rank joins its job or CUDA starts. A program that imports gpuflow sets the
variable itself before it imports torch; ``check_allocator`` says so when it did not.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from gpuflow.common.errors import GpuflowError

ALLOCATORS = ("native", "cudaMallocAsync", "expandable")
ENV = "PYTORCH_CUDA_ALLOC_CONF"
GENERIC_ENV = "PYTORCH_ALLOC_CONF"  # torch's newer name for the same settings, read too
# Set in the restarted process: a second restart would mean the variable did not take.
_RESTARTED = "GPUFLOW_ALLOCATOR_RESTARTED"
# The keys of the variable that choose the allocator; its other settings are left alone.
_KEYS = ("backend", "expandable_segments")


def _settings(conf: str) -> dict[str, str]:
    """``key:value,key:value`` as a dict, in order."""
    pairs = (item.partition(":") for item in conf.split(",") if item.strip())
    return {key.strip(): value.strip() for key, _, value in pairs}


def allocator_in(env: Mapping[str, str]) -> str:
    """The allocator an environment selects."""
    settings = {**_settings(env.get(GENERIC_ENV, "")), **_settings(env.get(ENV, ""))}
    if settings.get("backend") == "cudaMallocAsync":
        return "cudaMallocAsync"
    if settings.get("expandable_segments", "").lower() == "true":
        return "expandable"
    return "native"


def env_for(allocator: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``PYTORCH_CUDA_ALLOC_CONF`` selecting ``allocator`` (its other settings
    kept)."""
    settings = {k: v for k, v in _settings(env.get(ENV, "")).items() if k not in _KEYS}
    if allocator == "cudaMallocAsync":
        settings["backend"] = "cudaMallocAsync"
    elif allocator == "expandable":
        settings["expandable_segments"] = "True"
    changed = {k: v for k, v in env.items() if k not in (ENV, GENERIC_ENV)}
    generic = {k: v for k, v in _settings(env.get(GENERIC_ENV, "")).items() if k not in _KEYS}
    for name, kept in ((ENV, settings), (GENERIC_ENV, generic)):
        if kept:
            changed[name] = ",".join(f"{k}:{v}" for k, v in kept.items())
    return changed


def use_allocator(allocator: str, argv: list[str]) -> None:
    """Make ``allocator`` the one in effect for the command ``gpuflow ARGV``: nothing if it
    is (or is ``auto``), else the command starts again with the environment that selects it
    (no return). Call before CUDA starts and before a rank joins its job."""
    if allocator == "auto" or allocator_in(os.environ) == allocator:
        return
    if os.environ.get(_RESTARTED):
        raise GpuflowError(
            f"train.allocator={allocator} did not take effect ({ENV}="
            f"{os.environ.get(ENV, '')!r}); set {ENV} yourself before starting gpuflow"
        )
    env = env_for(allocator, os.environ)
    env[_RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "gpuflow", *argv], env)


def check_allocator(allocator: str) -> None:
    """Refuse a run whose ``allocator`` is not the one torch loaded with: it cannot change
    within a process."""
    in_effect = allocator_in(os.environ)
    if allocator != "auto" and in_effect != allocator:
        conf = env_for(allocator, {}).get(ENV, "")
        how = f"{ENV}={conf}" if conf else f"{ENV} without backend or expandable_segments"
        raise GpuflowError(
            f"train.allocator is {allocator} but this process has {in_effect}; the allocator "
            f"is chosen when torch loads: start Python with {how} (gpuflow train does this "
            "itself)"
        )
