"""Shared fixtures: a small real corpus, a prepared token folder, and the gpu marker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuflow.data.corpus import default_corpus
from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.device.accelerator import Device

SMALL_VOCAB = 512

pytest_plugins = ["pytester"]  # runs pytest on generated test files (the budget marker)


def _has_accelerator() -> bool:
    return Device.resolve("auto").is_accelerator


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs an accelerator (cuda, xpu or mps)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stdlib_documents():
    """The built-in corpus, read once per test session."""
    return default_corpus()


@pytest.fixture(scope="session")
def gpt2_shaped(stdlib_documents):
    """GPT-2's tokenizer layout (its vocabulary needs a network): a byte-level BPE whose
    end-of-text token is added after the merges, so that it has the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gpuflow.data.tokenizer import EOT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator((d.text for d in stdlib_documents[:200]), trainer)
    tok.add_special_tokens([EOT])
    return tok


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory, stdlib_documents) -> Path:
    """A folder of real text in every supported format: .txt, .md and .jsonl."""
    root = tmp_path_factory.mktemp("corpus")
    docs = stdlib_documents[:120]
    for i, doc in enumerate(docs[:40]):
        (root / f"doc{i:03d}.txt").write_text(doc.text, encoding="utf-8")
    (root / "notes").mkdir()
    for i, doc in enumerate(docs[40:60]):
        (root / "notes" / f"note{i:03d}.md").write_text(doc.text, encoding="utf-8")
    with open(root / "records.jsonl", "w", encoding="utf-8") as f:
        for doc in docs[60:]:
            f.write(json.dumps({"text": doc.text, "source": doc.source}) + "\n")
    return root


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory, small_corpus: Path) -> Path:
    """``small_corpus`` tokenized with a 512-token BPE: a ready token folder."""
    out = tmp_path_factory.mktemp("prepared") / "small"
    prepare(PrepareConfig(data=(str(small_corpus),), out=str(out), vocab_size=SMALL_VOCAB))
    return out


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh folder, as a user would: runs/ and data/ land here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def data_copy(prepared: Path, workdir: Path) -> Path:
    """A private copy of the prepared folder that a test may damage."""
    target = workdir / "tokens"
    shutil.copytree(prepared, target)
    return target


# Settings that make a run take a few seconds on 2 cores while still learning.
FAST = (
    "model.vocab_size=512",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "model.max_len=32",
    "train.batch_size=8",
    "train.warmup_steps=5",
    "train.eval_batches=2",
    "train.lr=0.003",
    "train.compile=false",  # compiling takes longer than these runs (tests/gpu check it)
)


def gpuflow_cli(
    *args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m gpuflow ARGS`` in a subprocess, as a user would from a shell (``env``:
    extra environment variables)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gpuflow", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_cli(*args: str, cwd: Path, nproc: int = 2) -> subprocess.Popen:
    """``torchrun -m gpuflow train ARGS``, started, its output into ``cwd/torchrun.log`` (a
    pipe nobody reads while the job runs would fill and stall it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "gpuflow", "train", *args,
    ]  # fmt: skip
    with open(cwd / "torchrun.log", "w") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def torchrun_ended(job: subprocess.Popen, cwd: Path, timeout: float = 180) -> str:
    """Wait for a ``torchrun_cli`` job to end (at most ``timeout`` s); its output."""
    job.wait(timeout=timeout)
    return (cwd / "torchrun.log").read_text()


def torchrun_workers(job: subprocess.Popen) -> dict[int, int]:
    """A running ``torchrun_cli`` job's worker processes: pid by rank (from /proc)."""
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
    ranks = {}
    for pid in map(int, workers.stdout.split()):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(v for v in environ if v.startswith(b"RANK="))
        ranks[int(rank.split(b"=")[1])] = pid
    return ranks


def line_holding(file: str, marker: str) -> int:
    """The line of ``file`` that holds ``marker``, other than a ``_line(...)`` call naming it
    (tests check the locations a ledger reports against it)."""
    for number, text in enumerate(Path(file).read_text().splitlines(), start=1):
        if marker in text and "_line(" not in text:
            return number
    raise AssertionError(marker)


def random_shards(folder: Path, sizes, dtype, high: int, seed: int = 0) -> list:
    """``train_*.bin`` shards of uniformly random ids below ``high``, opened."""
    import numpy as np

    from gpuflow.data.shards import Shard, write_shard

    rng = np.random.default_rng(seed)
    shards = []
    for i, n in enumerate(sizes):
        path = Path(folder) / f"train_{i:06d}.bin"
        write_shard(path, rng.integers(0, high, size=n).astype(dtype))
        shards.append(Shard.open(path))
    return shards
