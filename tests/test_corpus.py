"""Reading corpora: formats, folders, the built-in corpus, and bad files."""

from __future__ import annotations

import importlib.util
import json

import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.data.corpus import default_corpus, iter_documents, resolve_corpus_files


def test_folder_expands_to_supported_files_in_sorted_order(small_corpus):
    (small_corpus / "ignored.csv").write_text("a,b\n")
    files = resolve_corpus_files([small_corpus])
    assert files == sorted(files)
    assert {f.suffix for f in files} == {".txt", ".md", ".jsonl"}
    assert all(f.suffix != ".csv" for f in files)


def test_documents_come_one_per_text_file_and_one_per_jsonl_line(small_corpus):
    files = resolve_corpus_files([small_corpus])
    docs = list(iter_documents(files))
    n_lines = len((small_corpus / "records.jsonl").read_text().splitlines())
    assert len(docs) == 40 + 20 + n_lines
    first_line = json.loads((small_corpus / "records.jsonl").read_text().splitlines()[0])
    assert any(d.text == first_line["text"] for d in docs)


def test_builtin_corpus_is_real_deterministic_text(stdlib_documents):
    assert len(stdlib_documents) > 100
    total = sum(len(d.text) for d in stdlib_documents)
    assert total > 1_000_000  # about 2 MB of prose on CPython 3.11
    sources = [d.source for d in stdlib_documents]
    if importlib.util.find_spec("pydoc_data") is not None:
        assert "pydoc:lists" in sources  # the "lists" documentation topic
    assert any(s == "stdlib:json/__init__.py" for s in sources)
    assert [d.source for d in default_corpus()[:50]] == sources[:50]


def test_missing_path_is_refused(tmp_path):
    with pytest.raises(GpuflowError, match="does not exist"):
        resolve_corpus_files([tmp_path / "nope.txt"])


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(GpuflowError, match="empty"):
        resolve_corpus_files([tmp_path / "empty.txt"])


def test_binary_file_is_refused_with_the_offset(tmp_path):
    path = tmp_path / "image.txt"
    path.write_bytes(b"hello \xff\xfe\x00\x01 world")
    with pytest.raises(GpuflowError, match=r"not UTF-8 text \(bad byte at offset 6\)"):
        list(iter_documents(resolve_corpus_files([path])))


def test_text_with_nul_bytes_is_refused(tmp_path):
    path = tmp_path / "blob.md"
    path.write_bytes(b"abc\x00def")
    with pytest.raises(GpuflowError, match="NUL"):
        list(iter_documents([path]))


def test_unsupported_type_and_empty_folder_are_refused(tmp_path):
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(GpuflowError, match=r"unsupported type \.csv"):
        resolve_corpus_files([tmp_path / "data.csv"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(GpuflowError, match="holds no"):
        resolve_corpus_files([tmp_path / "empty_dir"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"content": "x"}', "no string field 'text'"),
        ('{"text": 5}', "no string field 'text'"),
    ],
)
def test_bad_jsonl_lines_are_refused_with_line_numbers(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(GpuflowError, match=rf"d.jsonl:2 .*{message}"):
        list(iter_documents([path]))


def test_document_sizes_add_up_to_the_bytes_on_disk(tmp_path, small_corpus):
    """Progress counts source bytes: every file's documents must account for all of it."""
    odd = tmp_path / "odd.jsonl"
    lines = [
        "",
        '{"text": "line\\u2028separator kept raw: \u2028 and ünïcødé"}',
        "   ",
        '{"text": "   "}',
        '{"text": "windows line end"}\r',
        '{"text": "last"}',
        "",
        "",
    ]
    odd.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8"))
    bom_text = tmp_path / "bom.txt"
    bom_text.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\n")
    for path in [odd, bom_text, *resolve_corpus_files([small_corpus])]:
        docs = list(iter_documents([path]))
        assert sum(d.size for d in docs) == path.stat().st_size, path
    assert [d.source.rsplit(":", 1)[1] for d in iter_documents([odd])] == ["2", "5", "6"]
    assert "\u2028" in next(iter_documents([odd])).text


def test_builtin_documents_count_their_utf8_bytes(stdlib_documents):
    assert all(d.size == len(d.text.encode("utf-8")) for d in stdlib_documents)
