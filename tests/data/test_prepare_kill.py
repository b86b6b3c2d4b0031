"""prepare killed with SIGKILL at every kind of moment, and two writers of one folder at once.

Each loop kills a real ``gpuflow prepare`` process (forked, see ``forked.py``) just before
one of its changes to the file system, or after a random delay, then runs the command
again. Whatever the moment, the folder is the old one or the whole new one, byte for byte
(never a mix, never missing where it was there), the command again ends with the new
folder (continuing from the finished shards where the killed run left them), an input is
never appended twice, and nothing of the killed run is left beside the folder."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from gpuflow.data.prepare.corpus import default_corpus
from tests.data.forked import Ended, Forker

SEED = 20261201
TIME_KILLS = 5  # kills after a random delay, beside those before a chosen change


def tree(folder: Path) -> dict[str, bytes] | None:
    """Every file of ``folder`` by name (meta.json without the seconds the run and its
    tokenizer took); None when there is no folder."""
    if not folder.exists():
        return None
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    meta = json.loads(files["meta.json"])
    meta.pop("seconds")
    meta.pop("tokenizer_seconds")
    files["meta.json"] = json.dumps(meta, sort_keys=True).encode()
    return files


def leftovers(work: Path) -> list[str]:
    """What a command left beside its folder: work folders, temporaries, its lock file."""
    return sorted(p.name for p in work.iterdir() if p.name.startswith("."))


def moments(clean: Ended, n_ops: int, rng: random.Random) -> list[tuple[str, float]]:
    """Where to kill: before ``n_ops`` of the changes a clean run made, drawn at random, half
    of them from its commit (from the removal of its progress file, after which a rerun
    starts afresh, to its end), and after random delays up to the clean run's length."""
    commit = next(i for i, op in enumerate(clean.ops, 1) if op.endswith("/progress.json"))
    committing, encoding = range(commit, len(clean.ops) + 1), range(1, commit)
    chosen = rng.sample(committing, min(len(committing), n_ops // 2))
    chosen += rng.sample(encoding, min(len(encoding), n_ops - len(chosen)))
    delays = [rng.uniform(0.0, clean.seconds) for _ in range(TIME_KILLS)]
    return [("op", n) for n in sorted(chosen)] + [("after", d) for d in delays]


def kill(forker: Forker, argv: list[str], work: Path, moment: tuple) -> Ended:
    kind, value = moment
    if kind == "op":
        return forker.run(argv, work, kill_at_op=value)
    return forker.run(argv, work, kill_after=value)


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    return [d.text for d in default_corpus()[:80]]


@pytest.fixture
def work(tmp_path: Path, stdlib_texts: list[str]) -> Path:
    """A corpus folder of 24 files and 20 JSON lines to append."""
    corpus = tmp_path / "work" / "corpus"
    corpus.mkdir(parents=True)
    for i, text in enumerate(stdlib_texts[:24]):
        (corpus / f"d{i:02d}.txt").write_text(text)
    with open(tmp_path / "work" / "more.jsonl", "w") as f:
        for text in stdlib_texts[40:60]:
            f.write(json.dumps({"text": text}) + "\n")
    return tmp_path / "work"


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory):
    with Forker(tmp_path_factory.mktemp("logs")) as server:
        yield server


PREPARE = ["prepare", "--data", "corpus", "--out", "out", "--vocab-size", "300",
           "--shard-tokens", "8192"]  # fmt: skip
APPEND = ["prepare", "--data", "more.jsonl", "--out", "out", "--append", "--shard-tokens", "8192"]


def test_prepare_killed_at_any_moment_leaves_the_old_folder_or_the_new_one(work, forker):
    """Every other kill is of a new folder's prepare, the others of --force over an old
    folder; the command again (with --force where a folder is there) finishes it."""
    out, rng = work / "out", random.Random(SEED)
    old = work / "old"
    assert forker.run([*PREPARE[:-4], "--vocab-size", "280", "--out", "old"], work).status == 0
    clean = forker.run(PREPARE, work)
    assert clean.status == 0, clean.output
    new = tree(out)
    continued = 0
    for number, moment in enumerate(moments(clean, 20, rng)):
        shutil.rmtree(out)
        force = number % 2 == 1
        if force:
            shutil.copytree(old, out)
        before = tree(out)
        killed = kill(forker, PREPARE + ["--force"] * force, work, moment)
        story = f"kill {number} {moment} (force: {force}):\n" + "\n".join(killed.ops[-3:])
        assert killed.status in (-9, 0), story + killed.output
        assert tree(out) in (before, new), story  # whole: the old folder or the new one
        again = forker.run(PREPARE + ["--force"] * out.exists(), work)
        assert again.status == 0, story + again.output
        continued += "continuing the interrupted prepare" in again.output
        assert tree(out) == new, story
        assert leftovers(work) == [], story
    assert continued >= 3  # kills between finished shards were continued from


def test_append_killed_at_any_moment_adds_its_input_once(work, forker):
    out, rng = work / "out", random.Random(SEED + 1)
    assert forker.run(PREPARE, work).status == 0
    saved = shutil.copytree(out, work / "saved")
    old = tree(out)
    clean = forker.run(APPEND, work)
    assert clean.status == 0, clean.output
    new = tree(out)
    assert new != old and json.loads(new["meta.json"])["inputs"][-1]["path"].endswith("more.jsonl")
    continued = refused = 0
    for number, moment in enumerate(moments(clean, 24, rng)):
        shutil.rmtree(out)
        shutil.copytree(saved, out)
        killed = kill(forker, APPEND, work, moment)
        story = f"kill {number} {moment}:\n" + "\n".join(killed.ops[-3:])
        assert killed.status in (-9, 0), story + killed.output
        after_kill = tree(out)
        assert after_kill in (old, new), story
        again = forker.run(APPEND, work)
        if after_kill == new:  # the input is in: the command again refuses to add it twice
            assert again.status == 2, story + again.output
            (line,) = again.errors
            assert "more.jsonl is already in out (the same file, unchanged)" in line, story
            refused += 1
        else:
            assert again.status == 0, story + again.output
            continued += "continuing the interrupted prepare" in again.output
        assert tree(out) == new, story
    assert continued >= 3 and refused >= 1
    # What killed runs left beside the folder goes with the next run that writes it.
    shutil.rmtree(out)
    shutil.copytree(saved, out)
    assert forker.run(APPEND, work).status == 0
    assert leftovers(work) == [] and tree(out) == new


def test_a_second_writer_is_refused_with_the_holders_pid_and_changes_nothing(work, forker):
    """An --append holds the folder (paused inside its run): a second --append and a
    --force rebuild with another vocabulary are refused, naming it; it then finishes, and the
    folder holds its input and its tokenizer only."""
    out = work / "out"
    assert forker.run(PREPARE, work).status == 0
    (work / "other.txt").write_text("another document, appended on its own " * 40)
    pid, log = forker.start(APPEND, work, pause_at_op=5, pause_s=3.0)
    lock = work / ".out.lock"
    while not (lock.exists() and lock.read_text().strip() == str(pid)):
        pass  # the holder has locked the folder and written its pid
    before = tree(out)
    second = ["prepare", "--data", "other.txt", "--out", "out", "--append"]
    rebuild = ["prepare", "--data", "corpus", "--out", "out", "--force", "--vocab-size", "400"]
    for argv in (second, rebuild, PREPARE):
        refused = forker.run(argv, work)
        assert refused.status == 2, refused.output
        (line,) = refused.errors
        assert f"out is being written by another gpuflow prepare (process {pid}" in line
        assert "wait for it to finish" in line
        assert tree(out) == before
    assert forker.wait(pid, log).status == 0
    meta = json.loads((out / "meta.json").read_text())
    assert [Path(i["path"]).name for i in meta["inputs"]][-1] == "more.jsonl"
    assert meta["vocab_size"] == 300
    assert forker.run(second, work).status == 0  # the folder is free again
    assert leftovers(work) == []
