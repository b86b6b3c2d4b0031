"""``gpuflow bench prepare``: the generated corpus, the timed child with the memory peaks of
its processes, and the hand-written tokenizers script against gpuflow prepare on the same
megabyte, generated or the user's (any input prepare reads), with held-out documents that
neither trains on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from gpuflow.bench.prepare import (
    FILE_BYTES,
    HOLD_OUT_EVERY,
    SEPARATOR,
    PrepareBenchConfig,
    builtin_held_out,
    generate_corpus,
    print_prepare_table,
    run_prepare_bench,
    run_timed,
)
from gpuflow.common.errors import GpuflowError
from tests.helpers import child_env, interrupt_as_children_start, processes_in, stopped


@pytest.fixture(autouse=True)
def corpus_read_once(monkeypatch, stdlib_documents):
    """The built-in corpus the session read already (reading it takes seconds)."""
    import gpuflow.data.prepare.corpus

    monkeypatch.setattr(gpuflow.data.prepare.corpus, "default_corpus", lambda: stdlib_documents)


def test_the_generated_corpus_has_the_size_asked_for_in_whole_characters(tmp_path):
    files, chars = generate_corpus(tmp_path / "gen", 1)
    assert sum(f.stat().st_size for f in files) == 1 << 20
    assert chars == sum(len(f.read_text(encoding="utf-8")) for f in files)
    assert all(f.stat().st_size <= FILE_BYTES for f in files)
    text = files[0].read_text(encoding="utf-8")  # whole characters: decodes
    assert text.count(SEPARATOR) > 10
    assert generate_corpus(tmp_path / "again", 1)[0][0].read_bytes() == files[0].read_bytes()
    held = builtin_held_out()
    assert held and not any(h in text for h in held[:20])  # held out of the corpus


def test_a_timed_child_gives_its_seconds_memory_and_output_or_one_line(tmp_path):
    """The child's peak, its own child's, and the peak of the two together."""
    grandchild = "x = bytearray(96 << 20); import time; time.sleep(0.6)"
    grow = (
        "import subprocess, sys, time; x = bytearray(48 << 20); "
        f"subprocess.run([sys.executable, '-c', {grandchild!r}]); print('done')"
    )
    result = run_timed([sys.executable, "-c", grow], tmp_path)
    assert result["stdout"] == "done\n" and result["seconds"] >= 0.6
    assert result["peak_main_bytes"] >= 48 << 20
    assert len(result["process_peaks_bytes"]) == 1 and result["process_peaks_bytes"][0] >= 96 << 20
    assert result["peak_process_bytes"] == result["process_peaks_bytes"][0]
    assert result["peak_rss_bytes"] >= (48 << 20) + (96 << 20)
    fail = "import sys; print('first', file=sys.stderr); sys.exit('the last line')"
    with pytest.raises(GpuflowError, match=r"^bench prepare: .* failed: the last line$"):
        run_timed([sys.executable, "-c", fail], tmp_path)


def test_an_interrupt_as_the_timed_child_starts_stops_it(tmp_path, monkeypatch):
    children = interrupt_as_children_start(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_timed([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
    assert len(children) == 1 and stopped(children)


def test_sigterm_stops_the_bench_and_its_child_and_removes_its_scratch_folder(tmp_path):
    """As Ctrl-C does; by default the bench died at once, its child writing on in a scratch
    folder nothing would remove."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "gpuflow", "bench", "prepare", "--mib", "16", "--out", "out"],
        cwd=tmp_path, env=child_env({"TMPDIR": str(tmp_path)}), stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    said = []
    for line in bench.stderr:
        said.append(line)
        if line.startswith("baseline"):
            break
    scratch = next(tmp_path.glob("gpuflow-bench-prepare-*"))
    deadline = time.monotonic() + 30
    while not processes_in(scratch) and time.monotonic() < deadline:
        time.sleep(0.05)  # the baseline's child, running in the scratch folder
    assert processes_in(scratch), "".join(said)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(60) != 0
    assert processes_in(tmp_path) == []
    assert not list(tmp_path.glob("gpuflow-bench-prepare-*"))


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
    assert 0 < script["tokens_per_byte"] < 1 and 0 < ours["tokens_per_byte"] < 1
    # prepare's own training time, from its closing line; the rest is reading and encoding
    assert 0 < ours["train_s"] < ours["seconds"]
    assert ours["encode_s"] == pytest.approx(ours["seconds"] - ours["train_s"])
    assert result["speedup_trained_on_all"] is None  # 1 MiB: the default sample is all of it
    print_prepare_table(result)
    assert "gpuflow prepare" in capsys.readouterr().out


def test_a_corpus_past_the_sample_also_runs_prepare_trained_on_all_of_it(
    tmp_path, monkeypatch, capsys
):
    """Where prepare's default sample is less than the corpus, a third row trains the
    tokenizer on all of it, as the script does. Here the bench's threshold is lowered while
    the child's default sample still holds the whole corpus: both rows train one tokenizer."""
    import gpuflow.data.prepare.pipeline

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    monkeypatch.setattr(gpuflow.data.prepare.pipeline, "DEFAULT_SAMPLE_MB", 0.5)
    result = run_prepare_bench(PrepareBenchConfig(mib=1, vocab_size=300, workers=1))
    assert list(tmp_path.iterdir()) == []
    script, ours, whole = result["rows"]
    assert whole["row"] == "gpuflow prepare, tokenizer on all of it"
    assert whole["documents"] == ours["documents"] == script["documents"]
    assert (whole["tokens"], whole["tokens_per_byte"]) == (ours["tokens"], ours["tokens_per_byte"])
    assert result["speedup_trained_on_all"] == pytest.approx(script["seconds"] / whole["seconds"])
    assert not ours["tokenizer_sample_reduced"] and not whole["tokenizer_sample_reduced"]
    print_prepare_table(result)
    assert "with its tokenizer on all of the corpus" in capsys.readouterr().out


def test_the_users_data_of_any_format_with_documents_held_out(
    tmp_path, monkeypatch, capsys, stdlib_documents
):
    """JSON lines given with --data: both read the same documents less every
    ``HOLD_OUT_EVERY``-th, and each tokenizer is measured on those it never saw."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    texts = [d.text for d in stdlib_documents[:200]]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = run_prepare_bench(PrepareBenchConfig(data=(str(data),), vocab_size=400, workers=1))
    assert list((tmp_path / "scratch").iterdir()) == []
    script, ours = result["rows"]
    held = len(texts) // HOLD_OUT_EVERY
    assert result["held_out_documents"] == held and result["corpus"] == [str(data)]
    assert result["held_out_bytes"] == sum(
        len(t.encode()) for t in texts[HOLD_OUT_EVERY - 1 :: HOLD_OUT_EVERY]
    )
    assert script["documents"] == ours["documents"] == len(texts) - held
    for row in (script, ours):
        assert 0 < row["tokens_per_byte"] < 1
        assert 0 < row["peak_process_bytes"] <= row["peak_rss_bytes"]
        assert row["peak_main_bytes"] <= row["peak_process_bytes"]
    assert result["tokens_per_byte_ratio"] == pytest.approx(
        ours["tokens_per_byte"] / script["tokens_per_byte"]
    )
    print_prepare_table(result)
    assert "held-out" in capsys.readouterr().out
