"""Fixtures for the tests of every layer: a small real corpus, a prepared token folder, the
accelerator; and the gpu marker's skip.

A test that needs an accelerator carries the ``gpu`` marker: a module of them sets
``pytestmark = pytest.mark.gpu`` and is named ``test_<name>_gpu.py``, beside the cpu tests of
its layer (a single test elsewhere is decorated with ``@pytest.mark.gpu``). Without an
accelerator each one is skipped; ``python -m pytest -m gpu`` selects exactly them. Helpers that
are no fixtures are in ``tests/helpers.py``."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from gpuflow.data.prepare.corpus import default_corpus
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.device.accelerator import Device
from tests.helpers import SMALL_VOCAB

pytest_plugins = ["pytester"]  # runs pytest on generated test files (the budget marker)


def _has_accelerator() -> bool:
    return Device.resolve("auto").is_accelerator


@pytest.fixture(autouse=True)
def _no_device_garbage_inherited(request: pytest.FixtureRequest) -> None:
    """Before a GPU test, collect the garbage cycles earlier tests left (a monkeypatched
    method closing over its loader makes one): a DataLoader worker forked while they hold
    CUDA tensors frees them in the child, where CUDA cannot be used, and the worker aborts."""
    if request.node.get_closest_marker("gpu") is not None:
        gc.collect()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = sorted(
        {i.nodeid.split("::")[0] for i in items if i.path.name.endswith("_gpu.py")}
        - {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("gpu")}
    )
    if unmarked:  # a test in a _gpu.py module that would run, and fail, on every cpu machine
        raise pytest.UsageError(
            f"{', '.join(unmarked)}: a *_gpu.py module needs pytestmark = pytest.mark.gpu"
        )
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs an accelerator (cuda, xpu or mps)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def accel() -> Device:
    """The accelerator a gpu test runs on (the best device here: cuda, xpu or mps)."""
    return Device.resolve("auto")


@pytest.fixture
def gpu0(accel: Device) -> Device:
    """The first cuda device (skips on another accelerator)."""
    if accel.type != "cuda":
        pytest.skip(f"peer copies are between cuda devices; this accelerator is {accel.type}")
    return Device("cuda", 0)


@pytest.fixture
def gpu1(gpu0: Device) -> Device:
    """The second cuda device (skips where there is only one)."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"a copy between two GPUs needs 2 cuda devices; this machine has {count}")
    return Device("cuda", 1)


@pytest.fixture(scope="session")
def stdlib_documents():
    """The built-in corpus, read once per test session."""
    return default_corpus()


@pytest.fixture(scope="session")
def gpt2_shaped(stdlib_documents):
    """GPT-2's tokenizer layout (its vocabulary needs a network): a byte-level BPE whose
    end-of-text token is added after the merges, so that it has the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gpuflow.data.tokenizer_file import EOT

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


@pytest.fixture
def piped(monkeypatch, capsys):
    """stdout and stderr are pipes, and COLUMNS says 80, as some CI runners do."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    return capsys
