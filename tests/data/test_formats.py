"""Reading corpora: every format on a real small file of it, documents split by separators,
long documents streamed in bounded parts, and bad input refused in one line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuflow.data.prepare.formats as formats
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.formats import ReadOptions, read_parts
from gpuflow.data.prepare.inputs import resolve_inputs
from tests.helpers import child_env


def documents(paths, **options) -> list[str]:
    """The documents of ``paths``, each joined from its parts."""
    docs: list[str] = []
    for inp in resolve_inputs([str(p) for p in paths]):
        for part in read_parts(inp, ReadOptions(**options)):
            if part.starts_document:
                docs.append(part.text)
            elif part.text:
                docs[-1] += part.text
    return docs


def sizes(path, **options) -> int:
    return sum(
        p.size
        for inp in resolve_inputs([str(path)])
        for p in read_parts(inp, ReadOptions(**options))
    )


def test_a_folder_expands_to_every_supported_file_in_order(small_corpus, tmp_path):
    small_corpus = shutil.copytree(small_corpus, tmp_path / "corpus")  # the fixture is shared
    (small_corpus / "ignored.csv").write_text("a,b\n")
    (small_corpus / ".git").mkdir(exist_ok=True)
    (small_corpus / ".git" / "notes.txt").write_text("not the corpus")
    with gzip.open(small_corpus / "zipped.txt.gz", "wt") as f:
        f.write("compressed text")
    inputs = resolve_inputs([small_corpus])
    names = [i.path.relative_to(small_corpus).as_posix() for i in inputs]
    assert names == sorted(names) and "zipped.txt.gz" in names
    assert not any(n.endswith(".csv") or n.startswith(".git") for n in names)
    assert {(i.kind, i.compression) for i in inputs} == {
        ("text", None), ("jsonl", None), ("text", "gzip")
    }  # fmt: skip


def test_documents_come_one_per_text_file_and_one_per_jsonl_line(small_corpus):
    docs = documents([small_corpus])
    n_lines = len((small_corpus / "records.jsonl").read_text().splitlines())
    assert len(docs) == 40 + 20 + n_lines
    first_line = json.loads((small_corpus / "records.jsonl").read_text().splitlines()[0])
    assert first_line["text"] in docs
    assert docs[0] == (small_corpus / "doc000.txt").read_text()  # a file as it is


def test_a_separator_splits_a_text_file_into_stripped_documents(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("Once upon a time.\n<|endoftext|>\n  The end.  <|endoftext|><|endoftext|>\n\n")
    assert documents([path], separator="<|endoftext|>") == ["Once upon a time.", "The end."]
    path.write_text("para one\nstill one\n\n\npara two\n\n")
    assert documents([path], separator="\n\n") == ["para one\nstill one", "para two"]
    assert sizes(path, separator="\n\n") == path.stat().st_size


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(["lorem", " ", "\n", "<|endoftext|>", "\n\n", "é", "  ", "東"]),
        min_size=1,
        max_size=120,
    ),
    st.sampled_from([5, 13, 64]),
    st.sampled_from(["<|endoftext|>", "\n\n"]),
)
def test_documents_are_the_same_whatever_the_read_size(tmp_path_factory, words, block, separator):
    """A separator cut by a read boundary is found all the same, and every byte is counted."""
    text = "".join(words)
    path = tmp_path_factory.mktemp("sep") / "t.txt"
    path.write_text(text)
    expected = [d.strip() for d in text.split(separator) if d.strip()]
    old = formats.READ_BYTES
    formats.READ_BYTES = block
    try:
        if not expected:
            with pytest.raises(GpuflowError, match="only whitespace"):
                documents([path], separator=separator)
            return
        assert documents([path], separator=separator) == expected
        assert sizes(path, separator=separator) == len(text.encode("utf-8"))
    finally:
        formats.READ_BYTES = old


def test_a_long_document_streams_in_parts_of_one_read(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "READ_BYTES", 1000)
    path = tmp_path / "book.md"
    text = "word " * 5000  # 25,000 characters, one document
    path.write_text(text)
    (inp,) = resolve_inputs([path])
    parts = list(read_parts(inp, ReadOptions()))
    assert len(parts) == 25 and max(len(p.text) for p in parts) <= 1000
    assert [p.starts_document for p in parts] == [True] + [False] * 24
    assert "".join(p.text for p in parts) == text


COMPRESSORS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": lambda data: pytest.importorskip("zstandard").ZstdCompressor().compress(data),
}


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_compressed_files_read_as_their_plain_text(tmp_path, small_corpus, suffix):
    plain = small_corpus / "records.jsonl"
    packed = tmp_path / f"records.jsonl.{suffix}"
    packed.write_bytes(COMPRESSORS[suffix](plain.read_bytes()))
    assert documents([packed]) == documents([plain])
    assert sizes(packed) == packed.stat().st_size  # progress counts the bytes on disk
    story = tmp_path / f"s.txt.{suffix}"
    story.write_bytes(COMPRESSORS[suffix](b"one<|endoftext|>two"))
    assert documents([story], separator="<|endoftext|>") == ["one", "two"]


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_a_damaged_compressed_file_is_named(tmp_path, small_corpus, suffix):
    data = COMPRESSORS[suffix]((small_corpus / "doc000.txt").read_bytes() * 20)
    damaged = tmp_path / f"doc.txt.{suffix}"
    damaged.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(GpuflowError, match=rf"doc\.txt\.{suffix} is not valid .*(damaged|trunc)"):
        documents([damaged])


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
@pytest.mark.parametrize("kept", [0.5, 0.9, 0.99])
def test_compressed_json_lines_cut_at_a_line_end_are_refused(tmp_path, suffix, kept):
    """Cut where what was decompressed ends at a line end, a file still reads as JSON lines;
    it must be refused all the same, naming the file, not read as fewer documents."""
    records = (json.dumps({"text": f"document {i} " + "word " * 40}) for i in range(3000))
    lines = "".join(f"{record}\n" for record in records)
    data = COMPRESSORS[suffix](lines.encode())
    cut = tmp_path / f"rows.jsonl.{suffix}"
    cut.write_bytes(data[: int(len(data) * kept)])
    with pytest.raises(GpuflowError, match=rf"corpus file .*rows\.jsonl\.{suffix} is not valid"):
        documents([cut])


def test_zstd_reads_every_frame_and_skips_skippable_ones(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    frames = [zstandard.ZstdCompressor().compress(f"part {i} ".encode() * 5000) for i in range(3)]
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    path = tmp_path / "parts.txt.zst"
    path.write_bytes(frames[0] + skippable + frames[1] + frames[2])
    (text,) = documents([path])
    assert text == "".join(f"part {i} " * 5000 for i in range(3))
    streamed = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True)
    path.write_bytes(streamed.compress(b"no size in the header " * 9000))
    assert documents([path]) == ["no size in the header " * 9000]
    path.write_bytes(frames[0] + skippable[:6])  # a skippable frame cut short
    with pytest.raises(GpuflowError, match=r"parts\.txt\.zst is not valid zstd data: it ends in"):
        documents([path])
    path.write_bytes(frames[0] + b"not a frame")
    with pytest.raises(GpuflowError, match=r"parts\.txt\.zst is not valid zstd data"):
        documents([path])


def test_jsonl_reads_the_field_it_is_told(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"content": "first", "text": 3}\n\n{"content": "second \\u2028 kept"}\r\n'
    )
    assert documents([path], text_field="content") == ["first", "second \u2028 kept"]
    assert sizes(path, text_field="content") == path.stat().st_size
    with pytest.raises(GpuflowError, match=r"d.jsonl:1 has no string field 'text'"):
        documents([path])


def test_a_null_text_in_jsonl_is_no_text_as_a_null_in_parquet_is(tmp_path):
    """A table exported with its missing values as null stopped prepare, where the same
    table as Parquet was read without its nulls."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first"}\n{"text": null}\n{"text": "second"}\n')
    assert documents([path]) == ["first", "second"]
    assert sizes(path) == path.stat().st_size
    path.write_text('{"text": null}\n')
    with pytest.raises(GpuflowError, match=r"d.jsonl has no non-empty 'text' field on any"):
        documents([path])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"content": "x"}', "no string field 'text'"),
        ('{"text": 5}', "no string field 'text'"),
        ('["text"]', "no string field 'text'"),
        ("5", "no string field 'text'"),
        ('{"text": "a\\u0000b"}', "NUL"),
        ('{"text": "ab \\ud800 cd"}', "lone surrogate .* fix or remove that line"),
        ('{"text": "\\udfff"}', "lone surrogate"),
    ],
)
def test_bad_jsonl_lines_are_refused_with_line_numbers(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(GpuflowError, match=rf"d.jsonl:2 .*{message}"):
        documents([path])


def test_parquet_is_read_a_batch_of_rows_at_a_time(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i} says something" if i % 7 else "" for i in range(3000)]
    table = pa.table({"id": list(range(3000)), "body": texts})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=500)
    assert documents([path], text_field="body") == [t for t in texts if t]
    assert sizes(path, text_field="body") == path.stat().st_size
    with pytest.raises(GpuflowError, match=r"rows.parquet has no column 'text' \(it has id, body"):
        documents([path])
    with pytest.raises(GpuflowError, match=r"column 'id' holds int64, not text"):
        documents([path], text_field="id")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(GpuflowError, match=r"bad.parquet is not a Parquet file"):
        documents([bad])


def test_a_categorical_text_column_is_read_as_its_text(tmp_path):
    """pandas writes a categorical column as a dictionary of strings: text all the same."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"genre {i % 3} and some words" for i in range(40)]
    path = tmp_path / "cats.parquet"
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), path)
    assert pq.read_schema(path).field("text").type == pa.dictionary(pa.int32(), pa.string())
    assert documents([path]) == texts


@pytest.mark.parametrize("kind", ["string_view", "large_string"])
def test_text_in_arrows_other_string_layouts_is_read_as_text(tmp_path, kind):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    arrow_type = getattr(pa, kind, None)
    if arrow_type is None:
        pytest.skip(f"this pyarrow has no {kind}")
    texts = [f"row {i} of some text" for i in range(30)]
    path = tmp_path / f"{kind}.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, type=arrow_type())}), path)
    assert documents([path]) == texts


def test_a_saved_dataset_is_read_from_its_train_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["alpha beta", "", "gamma"], "n": [1, 2, 3]}
    whole = datasets.Dataset.from_dict(rows)
    whole.save_to_disk(tmp_path / "one")
    assert documents([tmp_path / "one"]) == ["alpha beta", "gamma"]
    splits = datasets.DatasetDict({"train": whole, "test": datasets.Dataset.from_dict(rows)})
    splits.save_to_disk(tmp_path / "both")
    (inp,) = resolve_inputs([tmp_path / "both"])
    assert inp.kind == "dataset" and documents([tmp_path / "both"]) == ["alpha beta", "gamma"]
    only_test = datasets.DatasetDict({"test": whole})
    only_test.save_to_disk(tmp_path / "test-only")
    with pytest.raises(GpuflowError, match="holds splits test but no 'train'"):
        documents([tmp_path / "test-only"])
    with pytest.raises(GpuflowError, match="has no column 'body'"):
        documents([tmp_path / "one"], text_field="body")


def test_globs_name_files(tmp_path):
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text(name)
    assert documents([tmp_path / "*.txt"]) == ["a.txt", "b.txt"]
    with pytest.raises(GpuflowError, match="no file matches"):
        resolve_inputs([tmp_path / "*.jsonl"])


def test_a_glob_of_folders_reads_them_as_if_each_were_named(tmp_path):
    for name in ("books1", "books2", "empty1"):
        (tmp_path / name).mkdir()
    (tmp_path / "books1" / "a.txt").write_text("first book")
    (tmp_path / "books2" / "b.md").write_text("second book")
    (tmp_path / "empty1" / "notes.csv").write_text("x")
    assert documents([tmp_path / "books*"]) == ["first book", "second book"]
    with pytest.raises(GpuflowError, match=r"folder .*empty1 holds no \.txt"):
        resolve_inputs([tmp_path / "empty*"])


def test_a_valid_surrogate_pair_is_one_character(tmp_path):
    path = tmp_path / "emoji.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n')
    assert documents([path]) == ["smile \U0001f600"]


def test_standard_input_is_read_as_text(tmp_path):
    code = (
        "import sys\n"
        "from gpuflow.data.prepare.formats import ReadOptions, read_parts\n"
        "from gpuflow.data.prepare.inputs import resolve_inputs\n"
        "(inp,) = resolve_inputs(['-'])\n"
        "parts = list(read_parts(inp, ReadOptions(separator='\\n\\n')))\n"
        "print([p.text for p in parts], sum(p.size for p in parts))\n"
    )
    data = b"first doc\n\nsecond doc\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=data,
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        check=True,
    )
    assert out.stdout.decode().strip() == f"['first doc', 'second doc'] {len(data)}"
    with pytest.raises(GpuflowError, match="can be read once"):
        resolve_inputs(["-", "-"])


def test_missing_empty_unsupported_and_empty_folder_are_refused(tmp_path):
    with pytest.raises(GpuflowError, match="does not exist"):
        resolve_inputs([tmp_path / "nope.txt"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(GpuflowError, match="empty"):
        resolve_inputs([tmp_path / "empty.txt"])
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(GpuflowError, match=r"data\.csv is CSV, whose syntax would be trained"):
        resolve_inputs([tmp_path / "data.csv"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(GpuflowError, match="holds no"):
        resolve_inputs([tmp_path / "empty_dir"])
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        with pytest.raises(GpuflowError, match="not readable"):
            resolve_inputs([locked])


def test_a_folder_it_may_not_look_into_is_a_read_error_naming_it(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    (corpus / "locked").mkdir(parents=True)
    (corpus / "a.txt").write_text("text")
    (corpus / "locked" / "b.txt").write_text("more")
    if os.geteuid() == 0:  # root looks into anything: the kernel's refusal, as it comes
        real_stat = Path.stat

        def stat(path, *args, **kwargs):
            if path.parent.name == "locked":
                raise PermissionError(13, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(Path, "stat", stat)
    else:
        (corpus / "locked").chmod(0o600)  # listed, but nothing in it can be looked up
    try:
        for named in (corpus, corpus / "locked", corpus / "locked" / "b.txt"):
            with pytest.raises(GpuflowError) as error:
                resolve_inputs([named])
            line = str(error.value)
            assert line.startswith(f"cannot read {corpus / 'locked'}/"), line
            assert f"(permission denied), from --data {named}; check its permissions" in line
    finally:
        (corpus / "locked").chmod(0o700)


@pytest.mark.parametrize(
    ("name", "encoding", "family"),
    [("notes.txt", "UTF-16LE", "UTF-16"), ("notes.txt", "UTF-16BE", "UTF-16"),
     ("notes.txt", "UTF-32LE", "UTF-32"), ("rows.jsonl", "UTF-16LE", "UTF-16"),
     ("rows.jsonl", "UTF-32LE", "UTF-32")],  # (big-endian lines: json decodes them itself)
)  # fmt: skip
def test_text_in_a_wider_unicode_encoding_is_named_with_its_conversion(
    tmp_path, name, encoding, family
):
    """Windows tools save text as UTF-16 with a byte-order mark: the error names it and the
    command that converts it, to a name read as the same kind."""
    path = tmp_path / name
    text = json.dumps({"text": "a café"}) + "\n"
    path.write_bytes(("\ufeff" + text).encode(encoding))  # the mark, then the text
    stem, suffix = name.split(".")
    converted = tmp_path / f"{stem}.utf8.{suffix}"
    with pytest.raises(GpuflowError) as error:
        documents([path])
    assert str(error.value) == (
        f"corpus file {path} is {encoding} text (it starts with a {encoding} byte-order mark), "
        f"not UTF-8; convert it: iconv -f {family} -t UTF-8 {path} > {converted}"
    )
    converted.write_text(text, encoding="utf-8")  # what the command writes
    assert documents([converted]) == (["a café"] if suffix == "jsonl" else [text])


def test_binary_text_and_whitespace_are_refused_with_where(tmp_path):
    path = tmp_path / "image.txt"
    path.write_bytes(b"hello \xff\xfe\x00\x01 world")
    with pytest.raises(GpuflowError, match=r"image.txt is not UTF-8 text \(bad byte at offset 6\)"):
        documents([path])
    late = tmp_path / "late.txt"
    late.write_bytes(b"a" * 3000 + b"\xc3")  # a character cut off at the end of the file
    with pytest.raises(GpuflowError, match=r"offset 3000\)"):
        documents([late])
    blob = tmp_path / "blob.md"
    blob.write_bytes(b"abc\x00def")
    with pytest.raises(GpuflowError, match="NUL"):
        documents([blob])
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    with pytest.raises(GpuflowError, match="only whitespace"):
        documents([blank])


def test_a_bom_is_dropped_and_every_byte_is_counted(tmp_path):
    bom_text = tmp_path / "bom.txt"
    bom_text.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\n")
    assert documents([bom_text]) == ["café\n"]
    assert sizes(bom_text) == bom_text.stat().st_size
