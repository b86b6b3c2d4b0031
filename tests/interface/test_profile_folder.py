"""``gpuflow profile --out``: it writes only into a folder of its own, reuses one only when
every file there is as it wrote it, never writes through a link nor deletes a file it did not
write, leaves no half-written file and lets one profile at a time write a folder. The command
end to end: test_cli.py and test_commands.py; on the accelerator: test_interface_gpu.py."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.interface import profile_folder
from gpuflow.interface.profile import profile_training
from gpuflow.train.config import resolve_config
from tests.helpers import FAST

Profile = Callable[[Path], dict[str, Any]]


@pytest.fixture
def profile(prepared: Path, workdir: Path) -> Profile:
    """One timed step of the tiny preset on the cpu into a folder: about a second."""
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}"])
    return lambda out: profile_training(config, out, Device("cpu"), steps=1, warmup=0)


@pytest.fixture
def earlier(profile: Profile, workdir: Path) -> Path:
    """A folder that holds a profile gpuflow wrote."""
    profile(workdir / "prof")
    return workdir / "prof"


def contents(folder: Path) -> dict[str, bytes | str]:
    """What ``folder`` holds: each file's bytes, each link's target (never followed)."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in folder.iterdir()}


def test_a_profile_json_of_the_users_is_no_earlier_profile(profile, workdir):
    """The report's case: a folder of the user's that happens to hold a profile.json."""
    mine = workdir / "myproj"
    mine.mkdir()
    (mine / "profile.json").write_text('{"mine": 1}')
    (mine / "trace.json").write_text("MINE")
    (mine / "timeline.png").write_text("PNG")
    before = contents(mine)
    with pytest.raises(GpuflowError, match="myproj exists and is not a gpuflow profile folder"):
        profile(mine)
    assert contents(mine) == before


def test_its_own_profile_is_reused_and_vouches_for_its_files(profile, earlier):
    record = json.loads((earlier / "profile.json").read_text())
    assert record["format"] == profile_folder.PROFILE_FORMAT
    assert set(record["files"]) == {"trace.json"}  # no timeline on the cpu
    again = profile(earlier)
    assert sorted(contents(earlier)) == ["profile.json", "trace.json"]
    assert again["files"] == json.loads((earlier / "profile.json").read_text())["files"]


def test_a_file_of_the_users_beside_a_profile_is_refused_by_name(profile, earlier):
    (earlier / "notes.txt").write_text("my notes")
    before = contents(earlier)
    with pytest.raises(GpuflowError, match=r"also holds files gpuflow did not write \(notes.txt\)"):
        profile(earlier)
    assert contents(earlier) == before


@pytest.mark.parametrize("name", ["trace.json", "timeline.png"])
def test_a_trace_or_timeline_gpuflow_did_not_write_is_kept(profile, earlier, name):
    """A trace put in place of the profile's is kept (it was overwritten), and so is a
    timeline where the profile made none (it was deleted on the cpu, whoever wrote it)."""
    (earlier / name).write_bytes(b"the user's own")
    before = contents(earlier)
    with pytest.raises(GpuflowError, match=f"but {name} in it is not the file gpuflow wrote"):
        profile(earlier)
    assert contents(earlier) == before


@pytest.mark.parametrize("name", ["profile.json", "trace.json", "timeline.png"])
def test_a_link_at_a_name_profile_writes_is_neither_followed_nor_removed(
    profile, earlier, workdir, name
):
    """In a folder of gpuflow's own profile: a link put in place of one of its files."""
    outside = workdir / "elsewhere.txt"
    outside.write_text("not gpuflow's")
    (earlier / name).unlink(missing_ok=True)
    (earlier / name).symlink_to(outside)
    before = contents(earlier)
    with pytest.raises(GpuflowError, match=f"holds {name}, which is a link or not a regular"):
        profile(earlier)
    assert contents(earlier) == before and outside.read_text() == "not gpuflow's"


def test_an_output_folder_that_is_a_link_is_refused(profile, earlier, workdir):
    (workdir / "to-prof").symlink_to(earlier)
    with pytest.raises(GpuflowError, match="to-prof is a link to"):
        profile(workdir / "to-prof")


def test_a_profile_of_an_earlier_gpuflow_is_refused_with_what_to_do(profile, earlier):
    """Before the marker, nothing told its trace.json from a user's: it is not reused."""
    record = json.loads((earlier / "profile.json").read_text())
    old = {k: v for k, v in record.items() if k not in ("format", "files")}
    (earlier / "profile.json").write_text(json.dumps(old, indent=2))
    before = contents(earlier)
    with pytest.raises(GpuflowError, match="holds a profile of an earlier gpuflow"):
        profile(earlier)
    assert contents(earlier) == before


def test_only_a_timeline_gpuflow_wrote_there_goes_on_the_cpu(profile, earlier, workdir):
    """An accelerator's profile (its timeline written as a profile on one writes it) is
    profiled again on the cpu: its timeline, which would mislead, is removed."""
    trace = workdir / "accelerator-trace.json"
    trace.write_text('{"traceEvents": []}')
    with profile_folder.profile_folder(earlier):
        profile_folder.write_profile(earlier, {"steps": 1}, trace, b"\x89PNG of the device")
    assert (earlier / "timeline.png").exists()
    profile(earlier)
    assert sorted(contents(earlier)) == ["profile.json", "trace.json"]


def test_a_second_profile_into_a_folder_being_written_is_refused(profile, workdir):
    busy = workdir / "busy"
    running = profile_folder.profile_folder(busy)  # held as a profile running now holds it
    refused = pytest.raises(GpuflowError, match="busy is being written by another gpuflow profile")
    with running, refused:
        profile(busy)
    assert list(busy.iterdir()) == []
    profile(busy)  # and once that one is done, the folder is free
    assert sorted(contents(busy)) == ["profile.json", "trace.json"]


def test_a_trace_that_fails_half_written_leaves_the_earlier_profile_whole(
    profile, earlier, monkeypatch
):
    before = contents(earlier)
    export = torch.profiler.profile.export_chrome_trace
    calls = []

    def fail_the_timed_trace(self: torch.profiler.profile, path: str) -> None:
        calls.append(path)
        if len(calls) == 1:  # the counted pass's, which the report does not keep
            return export(self, path)
        Path(path).write_text('{"traceEvents": [')
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", fail_the_timed_trace)
    with pytest.raises(OSError, match="No space left"):
        profile(earlier)
    assert contents(earlier) == before


def test_a_profile_stopped_between_its_writes_leaves_a_folder_the_next_one_takes(
    profile, earlier, monkeypatch
):
    """Killed after profile.json went in, before the trace did (its temporary left), then
    profiled again."""
    written = profile_folder.write_atomic

    def stop_at_the_trace(path: Path, chunks: Any) -> None:
        if path.name == "trace.json":
            (path.parent / f".trace.json.tmp-{os.getpid()}").write_text('{"traceEv')
            raise KeyboardInterrupt
        written(path, chunks)

    monkeypatch.setattr(profile_folder, "write_atomic", stop_at_the_trace)
    with pytest.raises(KeyboardInterrupt):
        profile(earlier)
    assert sorted(contents(earlier)) == [f".trace.json.tmp-{os.getpid()}", "profile.json"]
    monkeypatch.undo()
    profile(earlier)
    assert sorted(contents(earlier)) == ["profile.json", "trace.json"]


def test_a_profile_that_fails_leaves_no_folder_it_made(workdir):
    config = resolve_config("tiny", None, [*FAST, "data.dir=missing"])
    with pytest.raises(GpuflowError, match="token folder missing does not exist"):
        profile_training(config, workdir / "new" / "prof", Device("cpu"), steps=1, warmup=0)
    assert not (workdir / "new" / "prof").exists()


def test_the_cli_refuses_a_folder_before_announcing_the_run(prepared, workdir, capsys):
    from gpuflow.interface.cli.main import main

    mine = workdir / "myproj"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    argv = ["profile", "--device", "cpu", "--steps", "1", "--warmup", "0", "--out", "myproj"]
    assert main([*argv, *sets]) == 2
    out, err = capsys.readouterr()
    assert "profiling" not in out and "not a gpuflow profile folder" in err
