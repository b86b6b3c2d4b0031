"""Atomic writes: never through a link or a file planted at their temporary name or at the
final name."""

from __future__ import annotations

import os

import pytest

from gpuflow.common.atomic import write_text_atomic
from gpuflow.common.errors import GpuflowError


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path):
    victim = tmp_path / "users-file.txt"
    victim.write_text("the user's words")
    run = tmp_path / "run"
    run.mkdir()
    planted = run / f".report.json.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    with pytest.raises(GpuflowError, match=r"is in the way of a file gpuflow writes"):
        write_text_atomic(run / "report.json", "{}")
    assert victim.read_text() == "the user's words"
    assert planted.is_symlink()  # not ours: left where it was
    assert not (run / "report.json").exists()
    dangling = run / f".config.toml.tmp-{os.getpid()}"
    dangling.symlink_to(tmp_path / "elsewhere" / "made.txt")
    with pytest.raises(GpuflowError):
        write_text_atomic(run / "config.toml", "x")
    assert not (tmp_path / "elsewhere").exists()  # the link's target was not created


def test_a_link_or_a_folder_at_the_final_name_is_refused_and_left(tmp_path):
    victim = tmp_path / "users-file.txt"
    victim.write_text("the user's words")
    link = tmp_path / "report.json"
    link.symlink_to(victim)
    with pytest.raises(GpuflowError, match=r"report.json is a link, where gpuflow writes"):
        write_text_atomic(link, "{}")
    assert victim.read_text() == "the user's words" and link.is_symlink()
    (tmp_path / "plot.png").mkdir()
    with pytest.raises(GpuflowError, match="is not a regular file"):
        write_text_atomic(tmp_path / "plot.png", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plot.png",
        "report.json",
        "users-file.txt",
    ]
    write_text_atomic(tmp_path / "fresh.json", "{}")  # absent, or a regular file: written
    write_text_atomic(tmp_path / "fresh.json", "[]")
    assert (tmp_path / "fresh.json").read_text() == "[]"
