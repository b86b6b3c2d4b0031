"""train.allocator: what an environment selects, the environment that selects each, and the
restart that puts it in effect before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.device.allocator import (
    ALLOCATORS,
    ENV,
    GENERIC_ENV,
    allocator_in,
    check_allocator,
    env_for,
    use_allocator,
)
from gpuflow.train.config import resolve_config
from tests.helpers import child_env


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_each_allocator_has_an_environment_that_selects_it_and_keeps_the_rest(allocator):
    before = {ENV: "max_split_size_mb:128,expandable_segments:True", "HOME": "/x"}
    env = env_for(allocator, before)
    assert allocator_in(env) == allocator
    assert env["HOME"] == "/x" and "max_split_size_mb:128" in env[ENV]
    assert env_for(allocator, env) == env  # settled: asking again changes nothing


def test_the_newer_variable_is_read_and_cleared_of_the_allocators_keys():
    env = {GENERIC_ENV: "backend:cudaMallocAsync,garbage_collection_threshold:0.6"}
    assert allocator_in(env) == "cudaMallocAsync"
    native = env_for("native", env)
    assert allocator_in(native) == "native"
    assert native[GENERIC_ENV] == "garbage_collection_threshold:0.6"
    assert allocator_in({}) == "native"


def test_an_allocator_torch_did_not_load_with_is_refused_with_the_way_to_set_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(GENERIC_ENV, raising=False)
    check_allocator("native")
    check_allocator("auto")
    with pytest.raises(GpuflowError, match=f"start Python with {ENV}=backend:cudaMallocAsync"):
        check_allocator("cudaMallocAsync")
    with pytest.raises(GpuflowError, match=r"train\.allocator must be one of"):
        resolve_config("tiny", None, ["train.allocator=fast"])


def test_a_restart_that_did_not_take_is_an_error_not_a_loop(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("GPUFLOW_ALLOCATOR_RESTARTED", "1")
    with pytest.raises(GpuflowError, match="did not take effect"):
        use_allocator("expandable", ["info"])
    use_allocator("auto", ["info"])  # auto and the allocator in effect: no restart
    use_allocator("native", ["info"])


def test_the_command_starts_again_with_the_allocator_in_its_environment(tmp_path):
    # A process that asks for expandable segments is replaced by `gpuflow info --json`
    # under the environment that selects them.
    script = "from gpuflow.device.allocator import use_allocator\n"
    script += "use_allocator('expandable', ['info', '--json', '--device', 'cpu'])\n"
    env = child_env(base={k: v for k, v in os.environ.items() if k not in (ENV, GENERIC_ENV)})
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["allocator"][ENV] == "expandable_segments:True"
