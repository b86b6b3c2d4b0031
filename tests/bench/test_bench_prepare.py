"""``gpuflow bench prepare``: the generated corpus, the timed child with its memory peak, and
the hand-written tokenizers script against gpuflow prepare on the same megabyte."""

from __future__ import annotations

import sys
import tempfile

import pytest

from gpuflow.bench.prepare import (
    FILE_BYTES,
    SEPARATOR,
    PrepareBenchConfig,
    generate_corpus,
    print_prepare_table,
    run_prepare_bench,
    run_timed,
)
from gpuflow.common.errors import GpuflowError
from tests.helpers import child_env


@pytest.fixture(autouse=True)
def corpus_read_once(monkeypatch, stdlib_documents):
    """The built-in corpus the session read already (reading it takes seconds)."""
    import gpuflow.data.corpus

    monkeypatch.setattr(gpuflow.data.corpus, "default_corpus", lambda: stdlib_documents)


def test_the_generated_corpus_has_the_size_asked_for_in_whole_characters(tmp_path):
    files = generate_corpus(tmp_path / "gen", 1)
    assert sum(f.stat().st_size for f in files) == 1 << 20
    assert all(f.stat().st_size <= FILE_BYTES for f in files)
    text = files[0].read_text(encoding="utf-8")  # whole characters: decodes
    assert text.count(SEPARATOR) > 10
    assert generate_corpus(tmp_path / "again", 1)[0].read_bytes() == files[0].read_bytes()


def test_a_timed_child_gives_its_seconds_memory_and_output_or_one_line(tmp_path):
    grow = "x = bytearray(64 << 20); import time; time.sleep(0.3); print('done')"
    result = run_timed([sys.executable, "-c", grow], tmp_path)
    assert result["stdout"] == "done\n" and result["seconds"] >= 0.3
    assert result["peak_rss_bytes"] >= 64 << 20
    fail = "import sys; print('first', file=sys.stderr); sys.exit('the last line')"
    with pytest.raises(GpuflowError, match=r"^bench prepare: .* failed: the last line$"):
        run_timed([sys.executable, "-c", fail], tmp_path)


def test_the_script_and_gpuflow_prepare_read_the_same_documents(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the children import gpuflow
    with pytest.raises(GpuflowError, match="--mib must be >= 1"):
        PrepareBenchConfig(mib=0)
    result = run_prepare_bench(PrepareBenchConfig(mib=1, vocab_size=300, workers=1))
    assert list(tmp_path.iterdir()) == []  # the scratch corpus and outputs are gone
    script, ours = result["rows"]
    assert (script["row"], ours["row"]) == ("tokenizers script", "gpuflow prepare")
    assert result["corpus_bytes"] == 1 << 20 and result["separator"] == SEPARATOR
    assert script["documents"] == ours["documents"] > 100
    assert script["tokens"] > 0 and ours["tokens"] > 0
    assert result["speedup"] == pytest.approx(script["seconds"] / ours["seconds"], rel=1e-6)
    print_prepare_table(result)
    assert "gpuflow prepare" in capsys.readouterr().out
