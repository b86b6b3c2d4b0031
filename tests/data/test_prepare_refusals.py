"""prepare refuses what it cannot do in one line, through the CLI: exit status 2, one
``error:`` line naming the file and saying what to do, no traceback, and the token folder
byte for byte as it was, with nothing left beside it.

--append reads a folder prepare wrote before: each way that folder can have been changed by
hand is refused before any work, and a fault at any write of --append (the faults of
tests/interface/test_write_faults.py) changes nothing either. Then the inputs and names that
used to end in a traceback or in a wrong folder."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuflow.interface.cli.main import main
from tests.interface.test_write_faults import ADVICE, WRITE_ERRORS, WriteFaults


def hashes(folder: Path) -> dict[str, str]:
    """A hash of every file under ``folder`` (links as links), by path."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[str(path)] = "link to " + os.readlink(path)
        elif path.is_file():
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[str(path)] = "folder"
    return found


def one_error(capsys: pytest.CaptureFixture, code: int) -> str:
    """The one ``error:`` line of a command that failed."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def hidden(folder: Path) -> list[str]:
    """Work folders, temporaries and lock files beside a token folder."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def tokens(prepared: Path, workdir: Path) -> Path:
    """A token folder in the working folder, with a file to append to it."""
    (workdir / "more.txt").write_text("More text to add, a document of its own. " * 30)
    return shutil.copytree(prepared, workdir / "tokens")


def _meta(**changes: object) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        for key, value in changes.items():
            if value is None:
                del meta[key]
            else:
                meta[key] = value
        (folder / "meta.json").write_text(json.dumps(meta))

    return change


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _cut(name: str) -> Callable[[Path], None]:
    def cut(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) - 10])

    return cut


def _other_tokenizer(folder: Path) -> None:
    from gpuflow.data.prepare.tokenizer import train_tokenizer

    texts = ["a completely different vocabulary for a folder that was changed by hand " * 20]
    train_tokenizer(texts, 300).save(str(folder / "tokenizer.json"))


ADVICE_PUT_BACK = "put back what prepare wrote, or rebuild the folder with gpuflow prepare --force"
DAMAGES = {
    "a file of the user's": (
        _write("train_final.bin", b"\0" * 2048),
        ["holds files gpuflow did not write (train_final.bin)", "move them out"],
    ),
    "a folder of the user's": (
        lambda folder: (folder / "plots").mkdir(),
        ["holds files gpuflow did not write (plots/)", "move them out"],
    ),
    "a shard that is a link": (
        lambda folder: (
            (folder / "train_000000.bin").unlink()
            or (folder / "train_000000.bin").symlink_to(folder / "val_000000.bin")
        ),
        ["did not write (train_000000.bin)"],
    ),
    "documents that are no count": (
        _meta(documents="many"),
        ["meta.json's documents is 'many', not a count", ADVICE_PUT_BACK],
    ),
    "inputs that are no list": (
        _meta(inputs=5),
        ["meta.json's inputs is 5, not a list of inputs", ADVICE_PUT_BACK],
    ),
    "inputs that are no inputs": (_meta(inputs=["x"]), ["meta.json's inputs is ['x']"]),
    "a negative count": (_meta(train_tokens=-1), ["meta.json's train_tokens is -1"]),
    "a count that is true": (_meta(val_shards=True), ["meta.json's val_shards is True"]),
    "no source": (_meta(source=None), ["meta.json's source is None, not text"]),
    "an unknown token type": (_meta(token_dtype="int8"), ["meta.json's token_dtype is 'int8'"]),
    "counts that disagree": (
        _meta(train_tokens=5),
        ["meta.json counts 1 train shards of 5 tokens but the folder holds 1", ADVICE_PUT_BACK],
    ),
    "a meta.json of no object": (
        _write("meta.json", b"[1, 2]"),
        ["is not a token folder that gpuflow prepare wrote"],
    ),
    "a missing shard": (
        lambda folder: (folder / "val_000000.bin").unlink(),
        ["meta.json counts 1 val shards", "the folder holds 0 (numbered none)"],
    ),
    "a shard more": (
        lambda folder: shutil.copy(folder / "train_000000.bin", folder / "train_000003.bin"),
        ["the folder holds 2 (numbered 0 to 3)", ADVICE_PUT_BACK],
    ),
    "a shard cut short": (_cut("val_000000.bin"), ["val_000000.bin is truncated"]),
    "a tokenizer of another vocabulary": (
        _other_tokenizer,
        ["its tokenizer.json has 300 tokens but meta.json states vocab_size 512", ADVICE_PUT_BACK],
    ),
    "a damaged tokenizer": (
        _write("tokenizer.json", b"{"),
        ["tokenizer.json is not a Hugging Face tokenizer.json", ADVICE_PUT_BACK],
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_append_refuses_a_folder_changed_by_hand_and_changes_nothing(tokens, capsys, damage):
    change, expected = DAMAGES[damage]
    change(tokens)
    before = hashes(tokens.parent)
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"])
    line = one_error(capsys, code)
    assert line.startswith("error: tokens ") or "tokens/" in line, line
    assert all(part in line for part in expected), line
    assert hashes(tokens.parent) == before
    assert hidden(tokens.parent) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tokenizer", "tokens"], "--append encodes with the folder's own tokenizer: leave"),
        (["--out", "nowhere"], "nowhere is not a token folder that gpuflow prepare wrote"),
        (["--out", "link"], "link is a link; --append writes only into the folder itself"),
        (["--data", "tokens/meta.json"], "meta.json is JSON, whose syntax would be trained on"),
    ],
)
def test_append_refuses_what_it_cannot_add_to_and_changes_nothing(tokens, capsys, args, expected):
    (tokens.parent / "link").symlink_to(tokens.name)
    before = hashes(tokens.parent)
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append", *args])
    assert expected in one_error(capsys, code)
    assert hashes(tokens.parent) == before


def test_append_refuses_an_input_twice_and_a_bad_one_midway(tokens, capsys, small_corpus):
    """The second --append of a file is refused; one whose second input is damaged is refused
    after the first was encoded, and nothing of it stays."""
    assert main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"]) == 0
    capsys.readouterr()
    before = hashes(tokens.parent)
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"])
    assert "more.txt is already in tokens (the same file, unchanged); leave it out" in one_error(
        capsys, code
    )
    with open(tokens.parent / "more.txt", "a") as f:  # it grew: its old text is in the folder
        f.write("And a sentence added later. ")
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"])
    line = one_error(capsys, code)
    assert "more.txt is already in tokens as it was then (1,230 bytes; 1,258 now)" in line, line
    assert "would add its old text twice" in line
    assert hashes(tokens.parent) == before | {
        str(tokens.parent / "more.txt"): hashlib.sha256(
            (tokens.parent / "more.txt").read_bytes()
        ).hexdigest()
    }
    mixed = tokens.parent / "mixed"
    mixed.mkdir()
    shutil.copy(small_corpus / "records.jsonl", mixed / "a.jsonl")
    (mixed / "b.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    before = hashes(tokens.parent)
    code = main(["prepare", "--data", "mixed", "--out", "tokens", "--append"])
    assert "mixed/b.jsonl:2 is not valid JSON" in one_error(capsys, code)
    assert hashes(tokens.parent) == before
    assert hidden(tokens.parent) == []


def test_a_fault_at_any_write_of_append_is_one_line_and_changes_nothing(
    tokens, monkeypatch, capsys
):
    append = ["prepare", "--data", "more.txt", "--out", "tokens", "--append",
              "--shard-tokens", "1024"]  # fmt: skip
    saved = shutil.copytree(tokens, tokens.parent / "saved")
    before = hashes(tokens)
    faults = WriteFaults(monkeypatch)
    assert main(append) == 0
    sites = list(faults.sites)
    assert len(sites) >= 4, sites  # the lock, a shard, the progress file, meta.json
    capsys.readouterr()
    for n, site in enumerate(sites):
        shutil.rmtree(tokens)
        shutil.copytree(saved, tokens)
        before = hashes(tokens)
        faults.fail_at, faults.error, faults.failed = site, WRITE_ERRORS[n % 6], None
        code = main(append)
        assert faults.failed is not None, site
        line = one_error(capsys, code)
        assert ADVICE[faults.error] in line, (site, line)
        assert hashes(tokens) == before, site
        kept = [name for name in hidden(tokens.parent)]
        assert all(f"kept in {name}" in line for name in kept), (site, line)
        for name in kept:
            shutil.rmtree(tokens.parent / name)


# ---- what used to end in a traceback or a wrong folder ------------------------------------


def test_a_lone_surrogate_in_json_lines_is_one_line(workdir, capsys):
    (workdir / "s.jsonl").write_text('{"text": "fine"}\n{"text": "ab \\ud800 cd"}\n')
    code = main(["prepare", "--data", "s.jsonl", "--out", "o", "--vocab-size", "300"])
    line = one_error(capsys, code)
    assert "s.jsonl:2 holds a lone surrogate" in line and "fix or remove that line" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["s.jsonl"]


def test_a_tokenizer_folder_without_its_file_is_named_as_such(workdir, capsys):
    """The folder was read for the run's fingerprint first: "No such file or directory"."""
    (workdir / "a.txt").write_text("some text to prepare\n" * 50)
    (workdir / "tk").mkdir()
    code = main(["prepare", "--data", "a.txt", "--out", "o", "--tokenizer", "tk"])
    assert "folder tk holds no tokenizer.json; pass the file itself" in one_error(capsys, code)
    assert sorted(p.name for p in workdir.iterdir()) == ["a.txt", "tk"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_named_as_data_is_one_line_that_says_to_use_standard_input(workdir, capsys):
    """What a shell's <(zcat corpus.gz) passes: a pipe, whose size reads 0."""
    os.mkfifo(workdir / "pipe.txt")
    code = main(["prepare", "--data", "pipe.txt", "--out", "o", "--vocab-size", "300"])
    line = one_error(capsys, code)
    assert "pipe.txt is a pipe or a device, not a file" in line and "--data -" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["pipe.txt"]


@pytest.mark.parametrize("out", [".", "..", "sub/.."])
def test_the_current_folder_is_no_output(workdir, small_corpus, capsys, out):
    code = main(["prepare", "--data", str(small_corpus), "--out", out])
    assert "is the current folder or holds it; choose another --out" in one_error(capsys, code)
    assert list(workdir.iterdir()) == []


def test_an_output_name_that_is_not_utf8_is_one_line(workdir, small_corpus):
    """Through a real process: the shell hands the bytes over as they are."""
    from tests.helpers import gpuflow_cli

    result = gpuflow_cli("prepare", "--data", str(small_corpus / "notes"),
                         "--out", os.fsdecode(b"d\xff"), cwd=workdir)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "--out d\\xff is not a UTF-8 name" in line and "choose a name of UTF-8" in line
    assert list(workdir.iterdir()) == []


def test_a_damaged_parquet_file_is_named_not_the_output(workdir, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"document {i} " + "some words here " * 30 for i in range(3000)]
    pq.write_table(pa.table({"text": texts}), workdir / "rows.parquet", row_group_size=1000)
    data = bytearray((workdir / "rows.parquet").read_bytes())
    for i in range(2000, len(data) // 2, 97):  # pages damaged, the footer whole
        data[i] ^= 0x5A
    (workdir / "rows.parquet").write_bytes(bytes(data))
    code = main(["prepare", "--data", "rows.parquet", "--out", "o_corrupt", "--vocab-size", "300"])
    line = one_error(capsys, code)
    assert line.startswith("error: corpus file rows.parquet cannot be read past row"), line
    assert "damaged or truncated" in line and "o_corrupt" not in line
    assert sorted(p.name for p in workdir.iterdir()) == ["rows.parquet"]


def test_a_pattern_of_folders_reads_them_or_is_one_line(workdir, small_corpus, capsys):
    """A pattern that matches folders reads them as if each were named, never the built-in
    corpus; one that matches only folders without text is refused."""
    shutil.copytree(small_corpus / "notes", workdir / "books1")
    (workdir / "books2").mkdir()
    (workdir / "books2" / "list.csv").write_text("a,b\n")
    code = main(["prepare", "--data", "books2*", "--out", "o", "--vocab-size", "300"])
    assert "folder books2 holds no .txt" in one_error(capsys, code)
    assert main(["prepare", "--data", "books1*", "--out", "o", "--vocab-size", "300"]) == 0
    meta = json.loads((workdir / "o" / "meta.json").read_text())
    assert meta["documents"] == 20 and meta["source"] == "books1*"


@pytest.mark.parametrize("error", [errno.EXDEV, errno.EPERM, errno.ENOSPC])
def test_append_where_hard_links_fail(tokens, monkeypatch, capsys, error):
    """Where the file system has no hard links, the old files are copied into the new folder
    (the same bytes); a link that fails otherwise is one line and changes nothing."""
    reference = shutil.copytree(tokens, tokens.parent / "reference")
    assert main(["prepare", "--data", "more.txt", "--out", "reference", "--append"]) == 0
    capsys.readouterr()
    before = hashes(tokens)

    def no_link(*args, **kwargs):
        raise OSError(error, os.strerror(error), str(args[1]))

    monkeypatch.setattr(os, "link", no_link)
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append"])
    if error == errno.ENOSPC:
        line = one_error(capsys, code)
        assert "No space left on device" in line and ADVICE[error] in line
        assert "nothing was written" in line and hashes(tokens) == before
    else:
        assert code == 0, capsys.readouterr().err
        appended = {p.name: p.read_bytes() for p in tokens.iterdir()}
        assert appended.keys() == {p.name for p in reference.iterdir()}
        for name, data in appended.items():
            if name != "meta.json":  # which names its folder
                assert data == (reference / name).read_bytes(), name
    assert hidden(tokens.parent) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data", "", "--out", "x"], "--data names an empty path"),
        (["--data", "more.txt", "--out", ""], "--out is empty; name a path, or leave --out out"),
        (["--data", "more.txt", "--tokenizer", " "], "--tokenizer is empty"),
    ],
    ids=["data", "out", "tokenizer"],
)
def test_an_empty_path_is_refused_not_taken_as_the_default(tokens, capsys, args, expected):
    """--data "$CORPUS" with the variable unset would read the working folder whole."""
    before = hashes(tokens.parent)
    assert expected in one_error(capsys, main(["prepare", *args]))
    assert hashes(tokens.parent) == before


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_file_named_twice_is_read_once_for_a_new_folder_as_for_append(tokens, capsys):
    """A new folder trained on and encoded the file once a name; then two names of it were
    refused, so that the shell's expansion of a glob over a link and its target could not be
    prepared. Both now read it once, as naming it once does."""
    workdir = tokens.parent
    (workdir / "alias.txt").symlink_to("more.txt")
    shutil.copytree(tokens, workdir / "appended_once")

    def contents(folder: str) -> list[str]:
        return [h for p, h in hashes(workdir / folder).items() if not p.endswith("meta.json")]

    for (twice, a), (once, b) in (
        ((["more.txt", "alias.txt", "--out", "twice"], "twice"),
         (["more.txt", "--out", "once"], "once")),
        ((["more.txt", "./more.txt", "--out", "tokens", "--append"], "tokens"),
         (["more.txt", "--out", "appended_once", "--append"], "appended_once")),
    ):  # fmt: skip
        assert main(["prepare", "--data", *twice]) == 0
        said = capsys.readouterr().err
        assert "1 file of those given is another name of a file read once" in said
        assert main(["prepare", "--data", *once]) == 0
        assert contents(a) == contents(b)
    assert hidden(workdir) == []


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("9" * 5000, "Exceeds the limit (4300 digits)"),
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ],
)
def test_json_lines_python_cannot_decode_are_one_line(workdir, capsys, field, reason):
    good = [json.dumps({"text": f"a document {i}"}) for i in range(20)]
    lines = [*good[:10], '{"text": "ok", "extra": ' + field + "}", *good[10:]]
    (workdir / "rows.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["prepare", "--data", "rows.jsonl", "--out", "o", "--vocab-size", "300"])
    line = one_error(capsys, code)
    assert f"rows.jsonl:11 cannot be read as JSON ({reason}" in line, line
    assert "fix or remove that line" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["rows.jsonl"]


def test_a_file_that_changes_while_it_is_read_is_refused_and_nothing_is_published(
    workdir, small_corpus, capsys, monkeypatch
):
    import gpuflow.data.prepare.pipeline as pipeline

    source = workdir / "book.txt"
    source.write_text((small_corpus / "notes" / "note000.md").read_text() * 20)
    encode = pipeline._encode

    def encode_after_a_change(*args, **kwargs):  # the file truncated once the reading began
        with open(source, "r+") as f:
            f.truncate(source.stat().st_size // 2)
        return encode(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_encode", encode_after_a_change)
    code = main(["prepare", "--data", "book.txt", "--out", "o", "--vocab-size", "300"])
    line = one_error(capsys, code)
    assert "book.txt changed while it was read" in line and "nothing was written" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["book.txt"]


def test_append_refuses_a_vocab_size_and_records_how_its_files_were_read(tokens, capsys):
    code = main(["prepare", "--data", "more.txt", "--out", "tokens", "--append",
                 "--vocab-size", "9999"])  # fmt: skip
    assert "leave --vocab-size out" in one_error(capsys, code)
    first = json.loads((tokens / "meta.json").read_text())
    assert "appends" not in first
    args = ["--separator", r"\n\n", "--val-fraction", "0.5"]
    assert main(["prepare", "--data", "more.txt", "--out", "tokens", "--append", *args]) == 0
    meta = json.loads((tokens / "meta.json").read_text())
    assert meta["separator"] == first["separator"]  # the folder's first run's, as before
    assert meta["appends"] == [
        {"source": "more.txt", "inputs": 1, "separator": "\n\n", "text_field": "text",
         "val_fraction": 0.5}
    ]  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("points_at", ["tokens", "empty", "nowhere"])
def test_an_output_that_is_a_link_is_refused_and_kept(tokens, capsys, force, points_at):
    """The new folder is renamed into --out's place: a link of the user's there was deleted
    (--force onto a link to a token folder, or a link to an empty folder)."""
    workdir = tokens.parent
    (workdir / "empty").mkdir()
    (workdir / "out").symlink_to(points_at)
    before = hashes(workdir)
    args = ["prepare", "--data", "more.txt", "--out", "out", "--vocab-size", "300"]
    code = main(args + (["--force"] if force else []))
    assert f"out is a link to {points_at}; pass --out the folder itself" in one_error(capsys, code)
    assert hashes(workdir) == before
    assert hidden(workdir) == []
