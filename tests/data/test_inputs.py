"""Which files a --data argument names: folders searched, globs expanded, files of no kind
read as text, and what is left out (empty files, links to nothing, pipes) counted and said."""

from __future__ import annotations

import gzip
import os
from collections import Counter
from pathlib import Path

import pytest

import gpuflow.data.prepare.formats as formats
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.inputs import resolve_inputs
from tests.data.test_formats import documents


def test_files_a_folder_holds_of_no_kind_read_are_listed_and_told_by_suffix(tmp_path, capsys):
    """A documentation folder as a system holds it: what is read is read, and the rest
    (no suffix, changelogs, sources) is counted by suffix in one line rather than dropped
    without a word; hidden entries are neither."""
    from gpuflow.data.prepare.inputs import describe_left_out
    from gpuflow.data.prepare.pipeline import PrepareConfig, prepare

    docs = tmp_path / "doc"
    for name in ("pkg/README.md", "pkg/notes.txt.gz", "pkg/copyright", "pkg/changelog.Debian.gz",
                 "other/copyright", "other/setup.py", ".git/HEAD.txt"):  # fmt: skip
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        body = ("words of a real note " * 200).encode()
        (docs / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    left_out: Counter = Counter()
    inputs = resolve_inputs([docs], left_out)
    assert [i.path.name for i in inputs] == ["README.md", "notes.txt.gz"]
    assert left_out == {"no suffix": 2, ".debian.gz": 1, ".py": 1}
    line = describe_left_out(left_out)
    assert line.startswith("note: 4 files of those given are left out, of no ")
    assert "no suffix 2" in line and ".debian.gz 1" in line and ".py 1" in line
    assert line.endswith("--data 'FOLDER/**/*.py'")  # a glob of the one simple suffix
    prepare(PrepareConfig(data=(str(docs),), out=str(tmp_path / "out"), vocab_size=300))
    assert "note: 4 files of those given" in capsys.readouterr().err


def test_files_named_or_globbed_of_no_kind_are_read_as_text(tmp_path):
    """Source code and other text named outright, or matched by a glob, is read as plain
    text (compressed too), one document a file; JSON, CSV and TSV are refused with what to
    do instead, and a binary file with its own line."""
    src = Path(formats.__file__).parent  # gpuflow's own sources: real code, as a user's
    code = tmp_path / "code"
    code.mkdir()
    for source in sorted(src.glob("*.py"))[:3]:
        (code / source.name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    (code / "notes.rst.gz").write_bytes(gzip.compress(b"A *note* in reStructuredText.\n"))
    (code / "Makefile").write_text("all:\n\techo made\n")
    inputs = resolve_inputs([f"{code}/*.py", code / "notes.rst.gz", code / "Makefile"])
    assert [(i.kind, i.compression) for i in inputs] == [("text", None)] * 3 + [
        ("text", "gzip"), ("text", None)]  # fmt: skip
    texts = documents([f"{code}/*.py", code / "notes.rst.gz", code / "Makefile"])
    want = [p.read_text(encoding="utf-8") for p in sorted(code.glob("*.py"))]
    assert texts[:3] == want and "reStructuredText" in texts[3] and "echo made" in texts[4]
    for name, what in (("rows.json", "JSON"), ("t.csv.gz", "CSV"), ("t.TSV", "TSV")):
        (tmp_path / name).write_bytes(b"x")
        with pytest.raises(GpuflowError, match=rf"{name} is {what}, .* rename it to \.txt"):
            resolve_inputs([tmp_path / name])
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(GpuflowError, match=r"logo\.png is not UTF-8 text"):
        documents([tmp_path / "logo.png"])


def test_empty_files_of_folders_and_globs_are_left_out_and_counted(tmp_path):
    """A tree of sources holds empty files (a package's __init__.py): a glob or a folder
    leaves them out and counts them; one named outright is refused, as is a glob or a folder
    with nothing else; a folder of no kind read says what it holds and the glob to use."""
    from gpuflow.data.prepare.inputs import describe_left_out

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "core.py").write_text("def f():\n    return 1\n")
    (pkg / "notes.txt").write_text("")
    left_out: Counter = Counter()
    inputs = resolve_inputs([f"{pkg}/**/*.py"], left_out)
    assert [i.path.name for i in inputs] == ["core.py"] and left_out == {"empty": 2}
    assert describe_left_out(left_out) == ("note: 2 files of those given are empty and left out")
    with pytest.raises(GpuflowError, match=r"__init__\.py is empty"):
        resolve_inputs([pkg / "__init__.py"])
    with pytest.raises(GpuflowError, match=r"every file that .*__init__\.py matches is empty"):
        resolve_inputs([f"{pkg}/**/__init__.py"])
    with pytest.raises(GpuflowError, match=(
            r"folder .*pkg holds no \.txt.* \(\.py 3, empty 1\); to read its files as plain "
            r"text, name them with a glob: --data '.*pkg/\*\*/\*\.py'")):  # fmt: skip
        resolve_inputs([pkg])
    (pkg / "README.md").write_text("# pkg\n")
    left_out = Counter()
    assert [i.path.name for i in resolve_inputs([pkg], left_out)] == ["README.md"]
    assert left_out == {".py": 3, "empty": 1}
    assert "left out, empty or of no kind prepare reads (.py 3, empty 1)" in describe_left_out(
        left_out)  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_parquet_files_of_no_rows_are_empty_files(tmp_path):
    """A job writing a table by partitions leaves a Parquet file of no rows for an empty one:
    a folder or glob leaves it out as an empty file, one named outright is refused as one."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = tmp_path / "table"
    table.mkdir()
    pq.write_table(pa.table({"text": ["one document", "another"]}), table / "part-0.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), table / "part-1.parquet")
    for given in (table, f"{table}/*.parquet"):
        left_out: Counter = Counter()
        inputs = resolve_inputs([given], left_out)
        assert [i.path.name for i in inputs] == ["part-0.parquet"] and left_out == {"empty": 1}
    with pytest.raises(GpuflowError, match=r"part-1\.parquet is empty"):
        resolve_inputs([table / "part-1.parquet"])
    # Not Parquet inside: left to the reading, which names what is wrong.
    (table / "part-2.parquet").write_bytes(b"not a table")
    assert len(resolve_inputs([table])) == 2


def test_links_to_nothing_are_counted_and_said_not_skipped(tmp_path):
    """A git-annex or DVC checkout not fetched holds links to a store that is not there: a
    folder counts them in its note, and one or a glob holding nothing else says to fetch."""
    from gpuflow.data.prepare.inputs import describe_left_out

    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"doc{i}.txt").symlink_to(tmp_path / "store" / f"object{i}")
    for where, expected in (
        (data, r"folder .*data holds no \.txt.* \(link to nothing 3\); fetch what the links"),
        (f"{data}/*.txt", r"every file that .*\*\.txt matches is a link to nothing; fetch what"),
        (data / "doc0.txt", r"doc0\.txt is a link to .*object0, which does not exist; fetch"),
    ):
        with pytest.raises(GpuflowError, match=expected):
            resolve_inputs([where])
    (data / "real.txt").write_text("a document that is here")
    for where in (data, f"{data}/*.txt"):
        left_out: Counter = Counter()
        assert [i.path.name for i in resolve_inputs([where], left_out)] == ["real.txt"]
        assert left_out == {"link to nothing": 3}
        assert describe_left_out(left_out) == (
            "note: 3 files of those given are left out (link to nothing 3); "
            "fetch what the links point at (git annex get, dvc pull) to read them"
        )


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_link_to_a_folder_inside_a_folder_is_counted_and_said_not_skipped(tmp_path):
    """Its files were left out without a word; named in --data, the folder is read."""
    from gpuflow.data.prepare.inputs import describe_left_out

    elsewhere, data = tmp_path / "elsewhere", tmp_path / "data"
    elsewhere.mkdir()
    data.mkdir()
    for i in range(3):
        (elsewhere / f"doc{i}.txt").write_text(f"document {i}")
    (data / "more").symlink_to(elsewhere)
    with pytest.raises(GpuflowError, match=r"\(link to a folder 1\); links to folders are not"):
        resolve_inputs([data])
    (data / "real.txt").write_text("a document that is here")
    left_out: Counter = Counter()
    assert [i.path.name for i in resolve_inputs([data], left_out)] == ["real.txt"]
    assert left_out == {"link to a folder": 1}
    assert describe_left_out(left_out) == (
        "note: 1 file of those given is left out (link to a folder 1); links "
        "to folders are not followed: name such a folder in --data to read it"
    )
    named = [i.path.name for i in resolve_inputs([data, data / "more"])]
    assert named == ["real.txt", "doc0.txt", "doc1.txt", "doc2.txt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_in_a_folder_is_counted_and_said_not_skipped(tmp_path):
    from gpuflow.data.prepare.inputs import describe_left_out

    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "feed.txt")  # read, it would block until a writer came
    with pytest.raises(GpuflowError, match=r"folder .*data holds no .*\(pipe or device 1\); point"):
        resolve_inputs([data])
    (data / "real.txt").write_text("a document that is here")
    (data / "empty.txt").touch()
    left_out: Counter = Counter()
    assert [i.path.name for i in resolve_inputs([data], left_out)] == ["real.txt"]
    assert left_out == {"pipe or device": 1, "empty": 1}
    assert describe_left_out(left_out) == (
        "note: 2 files of those given are left out (empty 1, pipe or device 1): "
        "prepare reads regular files only"
    )


def test_an_empty_data_path_is_refused_not_read_as_the_working_folder():
    with pytest.raises(GpuflowError, match="--data names an empty path"):
        resolve_inputs([""])


def test_the_left_out_line_always_counts_the_links_its_advice_is_about():
    from gpuflow.data.prepare.inputs import describe_left_out

    left_out = Counter(
        {".json": 29, ".safetensors": 23, ".bin": 6, ".toml": 4, "link to nothing": 1}
    )
    assert describe_left_out(left_out) == (
        "note: 63 files of those given are left out (.json 29, .safetensors 23, "
        ".bin 6, .toml 4, link to nothing 1); fetch what the links point at (git annex get, "
        "dvc pull) to read them"
    )


def test_a_datasets_own_files_are_not_counted_as_left_out(tmp_path):
    mixed = tmp_path / "mixed"
    for name in ("ds/dataset_info.json", "ds/train/data-00000.arrow", "notes.txt", "img.png"):
        (mixed / name).parent.mkdir(parents=True, exist_ok=True)
        (mixed / name).write_text("some text of a file")
    left_out: Counter = Counter()
    inputs = resolve_inputs([mixed], left_out)
    assert [(i.path.name, i.kind) for i in inputs] == [("ds", "dataset"), ("notes.txt", "text")]
    assert left_out == {".png": 1}


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_one_file_named_twice_is_read_once_and_its_other_names_counted(tmp_path):
    """Each name of a file (a link, a path through .., a hard link, a folder and a glob that
    hold it) was read in full before names were compared; then two arguments naming it were
    refused, so that the shell's expansion of a glob over a link and its target could not be
    prepared, where the same glob quoted was."""
    data = tmp_path / "in"
    data.mkdir()
    first, other = data / "a.txt", data / "b.txt"
    first.write_text("a document of its own")
    other.write_text("a document of its own")  # the same text in another file: read
    (tmp_path / "alias.txt").symlink_to(first)
    os.link(first, tmp_path / "hard.txt")
    (data / "link.txt").symlink_to("a.txt")
    for named, read, others in (
        ([first, data / ".." / "in" / "a.txt"], [first], 1),
        ([first, tmp_path / "alias.txt"], [first], 1),
        ([data, tmp_path / "hard.txt"], [first, other], 2),  # in/link.txt too
        ([f"{data}/*.txt", data / "b.txt"], [first, other], 2),
        (sorted(data.glob("*.txt")), [first, other], 1),  # as the shell expands in/*.txt
    ):
        left_out: Counter = Counter()
        assert [i.path for i in resolve_inputs(named, left_out)] == read
        assert left_out == {"name of a file read": others}, named
    assert [i.path for i in resolve_inputs([first, other])] == [first, other]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
@pytest.mark.parametrize("given", ["folder", "glob"])
def test_a_folder_or_glob_that_reaches_one_file_twice_reads_it_once(tmp_path, given):
    """A link beside its target (/usr/share/doc holds such, as does a Python install) made
    the whole folder a refusal that no option could get past."""
    from gpuflow.data.prepare.inputs import describe_left_out

    data = tmp_path / "in"
    data.mkdir()
    (data / "a.txt").write_text("the one document")
    (data / "b.txt").symlink_to("a.txt")
    os.link(data / "a.txt", data / "c.txt")
    (data / "d.txt").write_text("another")
    left_out: Counter = Counter()
    named = data if given == "folder" else f"{data}/*.txt"
    inputs = resolve_inputs([named], left_out)
    assert [i.path.name for i in inputs] == ["a.txt", "d.txt"]
    assert left_out == {"name of a file read": 2}
    assert describe_left_out(left_out) == (
        "note: 2 files of those given are another name of a file read once and left out"
    )


def test_json_left_out_of_a_folder_gets_advice_that_works(tmp_path):
    """The note said to name .json files with a glob, which then refused them as JSON."""
    from gpuflow.data.prepare.inputs import describe_left_out

    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "config.json").write_text('{"a": 1}')
    left_out: Counter = Counter()
    resolve_inputs([tmp_path], left_out)
    note = describe_left_out(left_out)
    assert "(.json 1); JSON files are read only as documents in .jsonl or .parquet" in note
    assert "--data" not in note
    (tmp_path / "a.txt").unlink()
    with pytest.raises(GpuflowError, match=r"\(\.json 1\); JSON files are read only as"):
        resolve_inputs([tmp_path])
    (tmp_path / "notes.rst").write_text("text")
    (tmp_path / "b.txt").write_text("text")
    left_out = Counter()
    resolve_inputs([tmp_path], left_out)
    assert describe_left_out(left_out).endswith("--data 'FOLDER/**/*.rst'")


def test_a_blank_line_separator_found_nowhere_mentions_windows_line_ends(tmp_path):
    """A file of CRLF lines holds no "\\n\\n": each file was one document, and the note did not
    say why."""
    from gpuflow.data.prepare.inputs import separator_unseen

    (tmp_path / "a.txt").write_bytes(b"one\r\n\r\ntwo\r\n")
    inputs = resolve_inputs([tmp_path / "a.txt"])
    assert "Windows line ends need \\r\\n in it" in separator_unseen("\n\n", inputs, 1)
    assert "Windows" not in separator_unseen("<|sep|>", inputs, 1)
