"""Which inputs a corpus's ``--data`` names: files, folders, globs and ``-`` (standard
input), each of a kind ``formats.read_parts`` reads (text, JSON lines, Parquet, any of them
compressed, folders saved by ``datasets``), checked before anything is read or written.

What each kind is, and which files are left out: docs/architecture/data.md (Reading a
corpus).
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.streams import check_zstd_frames

KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
# A file named outright (or matched by a glob) whose suffix is none of KINDS is read as plain
# text (source code, .rst, a README), except these: their syntax would be trained on as prose.
STRUCTURED = {".json": "JSON", ".csv": "CSV", ".tsv": "TSV"}
EMPTY = "empty"  # how empty files of the folders and globs given are counted as left out
# How links to nothing are counted: a checkout whose files are links to a store not fetched
# (git-annex, DVC) holds only these, and would otherwise train on what else it holds unsaid.
BROKEN_LINK = "link to nothing"
NOT_A_FILE = "pipe or device"  # a named pipe, a socket, a device node: no text to read twice
# A link to a folder inside a folder given is not followed (it may lead out of the folder, or
# back into it); counted, so its files are not left out unsaid.
LINKED_FOLDER = "link to a folder"
LINKED_ADVICE = "links to folders are not followed: name such a folder in --data to read it"
UNREADABLE = (EMPTY, BROKEN_LINK, NOT_A_FILE, LINKED_FOLDER)  # left out whatever the suffix
# --data reaching one file twice (a link beside its target, a hard link, two arguments that
# name it) reads it once: counted, as the other names are left out.
SAME_FILE = "name of a file read"
FETCH = "fetch what the links point at (git annex get, dvc pull)"
LINKS_ADVICE = f"{FETCH}, or leave them out"
# What a dataset folder written by ``datasets``' save_to_disk holds.
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")


@dataclass(frozen=True)
class Input:
    """One corpus input: a file, a dataset folder, or standard input (``path`` None)."""

    path: Path | None
    kind: str  # text, jsonl, parquet, dataset
    compression: str | None = None

    @property
    def name(self) -> str:
        return "-" if self.path is None else str(self.path)

    def size(self) -> int | None:
        """Bytes on disk (a dataset: its files'); None for standard input."""
        if self.path is None:
            return None
        if self.kind == "dataset":
            return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return self.path.stat().st_size

    def identity(self) -> dict[str, Any] | None:
        """What says the input has not changed (path, size, modification time); None for
        standard input, which cannot be read again."""
        if self.path is None:
            return None
        stat = self.path.stat()
        return {"path": str(self.path.resolve()), "size": self.size(), "mtime_ns": stat.st_mtime_ns}


def kind_of(path: Path) -> tuple[str | None, str | None]:
    """(format, compression) from a file's suffixes; format None: not a corpus file."""
    suffix, compression = _suffix_and_compression(path)
    return KINDS.get(suffix), compression


def _suffix_and_compression(path: Path) -> tuple[str, str | None]:
    """A file's last suffix less a compression's, lower case ('' for none), and the
    compression."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    return (suffixes[-1] if suffixes else ""), compression


def is_dataset_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in DATASET_MARKERS)


def _supported() -> str:
    kinds = ", ".join(KINDS)
    return f"{kinds} files (maybe {', '.join(COMPRESSIONS)}), dataset folders or -"


def resolve_inputs(
    paths: Sequence[str | Path], left_out: Counter[str] | None = None
) -> list[Input]:
    """The inputs that ``paths`` name, in order (folders and globs sorted), each checked to
    exist and be readable as its kind before anything is read or written. Files inside the
    folders named that are of no kind read here are counted in ``left_out`` by their last two
    suffixes (``left_suffix``), and empty files and links to nothing of the folders and globs
    as ``EMPTY`` and ``BROKEN_LINK`` (a file named outright that is either is refused); a
    file named, or matched by a glob, of no kind here is read as plain text, unless its
    syntax is ``STRUCTURED``."""
    if not paths:
        raise GpuflowError(
            "no corpus given; pass --data FILE_OR_FOLDER (or leave it out for the built-in corpus)"
        )
    named: list[list[Input]] = []  # by --data argument
    left_out = Counter() if left_out is None else left_out
    for raw in paths:
        try:
            named.append(_inputs_named(str(raw), left_out))
        except PermissionError as exc:  # a folder it may not look into, on the way or inside
            raise GpuflowError(
                f"cannot read {exc.filename or raw} (permission denied), from --data {raw}; "
                "check its permissions, or leave it out"
            ) from None
    if sum(i.path is None for group in named for i in group) > 1:
        raise GpuflowError("- (standard input) can be read once: name it once in --data")
    inputs = _each_file_once(named, left_out)
    for inp in inputs:
        if inp.path is not None and inp.kind != "dataset" and holds_nothing(inp.path):
            raise GpuflowError(f"corpus file {inp.path} is empty; remove it or add text to it")
    return inputs


def holds_nothing(path: Path) -> bool:
    """No bytes, or a Parquet file of no rows: what a job that writes a table by partitions
    leaves for an empty one. Either is left out of a folder or glob, and refused when named."""
    if path.stat().st_size == 0:
        return True
    if kind_of(path) != ("parquet", None):
        return False
    try:
        import pyarrow.parquet as pq

        with open(path, "rb") as source:  # pyarrow opens only names that are UTF-8
            return pq.ParquetFile(source).metadata.num_rows == 0
    except Exception:  # no pyarrow, or not Parquet: reading it says so, in its own words
        return False


def _each_file_once(named: list[list[Input]], left_out: Counter[str]) -> list[Input]:
    """The inputs of every --data argument, each file once: another name of a file read
    already (a link beside its target, a hard link, ``in/../in/a.txt``, a folder and a glob
    that both hold it, or the shell's expansion of a glob that matches a link) is left out
    and counted as ``SAME_FILE``, rather than trained on and encoded twice."""
    seen: set[tuple[int, int]] = set()
    kept = []
    for inputs in named:
        for inp in inputs:
            if inp.path is not None:
                stat = inp.path.stat()  # a link's target: the file itself, whatever its name
                if (stat.st_dev, stat.st_ino) in seen:
                    left_out[SAME_FILE] += 1
                    continue
                seen.add((stat.st_dev, stat.st_ino))
            kept.append(inp)
    return kept


def _inputs_named(raw: str, left_out: Counter[str]) -> list[Input]:
    """The inputs one --data argument names: standard input, a glob's matches, a file or a
    folder."""
    if raw == "-":
        return [Input(None, "text")]
    if not raw.strip():  # Path("") is the working folder: an unset shell variable, read whole
        raise GpuflowError("--data names an empty path; name a file, folder or glob")
    path = Path(raw)
    if not path.exists() and any(ch in raw for ch in "*?["):
        matched = sorted(Path(p) for p in glob.glob(raw, recursive=True))
        if not matched:
            raise GpuflowError(f"no file matches {raw}; check the --data pattern")
        # What it matches counts as if each were named (a folder is read whole), less empty
        # files, which a tree of sources holds many of (a package's __init__.py).
        broken = {p for p in matched if _is_broken_link(p)}
        empty = {p for p in matched if p.is_file() and holds_nothing(p)}
        kept = [p for p in matched if p not in broken and p not in empty]
        if not kept:
            what = " or ".join(w for w, n in (("empty", empty), ("a link to nothing", broken)) if n)
            advice = LINKS_ADVICE if broken else "check the pattern"
            raise GpuflowError(f"every file that {raw} matches is {what}; {advice}")
        left_out.update(+Counter({EMPTY: len(empty), BROKEN_LINK: len(broken)}))  # no zeros
        return [i for p in kept for i in _inputs_of(p, str(p), left_out)]
    if _is_broken_link(path):
        raise GpuflowError(
            f"corpus path {path} is a link to {os.readlink(path)}, which does not exist; "
            + LINKS_ADVICE
        )
    if not path.exists():
        raise GpuflowError(f"corpus path {path} does not exist; check the --data argument")
    return _inputs_of(path, raw, left_out)


def _is_broken_link(path: Path) -> bool:
    return path.is_symlink() and not path.exists()


def _inputs_of(path: Path, given: str, left_out: Counter[str]) -> list[Input]:
    if path.is_dir() and not is_dataset_folder(path):
        return _folder_inputs(path, left_out)
    return [_input_for(path, given)]


def _folder_inputs(folder: Path, left_out: Counter[str]) -> list[Input]:
    found: list[Input] = []
    here: Counter[str] = Counter()  # what this folder leaves out
    in_dataset: dict[Path, bool] = {folder: False}  # by folder: it or one above is a dataset

    def inside_dataset(entry: Path) -> bool:
        parent = entry.parent
        if parent not in in_dataset:
            in_dataset[parent] = is_dataset_folder(parent) or inside_dataset(parent)
        return in_dataset[parent]

    for entry in sorted(folder.rglob("*")):
        relative = entry.relative_to(folder).parts
        if any(part.startswith(".") for part in relative):
            continue  # .git and the like
        if is_dataset_folder(entry):
            found.append(Input(entry, "dataset"))
        elif not entry.is_file():  # a folder, a pipe, a link to nothing
            if inside_dataset(entry):
                continue
            if entry.is_dir():
                if entry.is_symlink():
                    here[LINKED_FOLDER] += 1
            else:
                here[BROKEN_LINK if _is_broken_link(entry) else NOT_A_FILE] += 1
            continue
        elif inside_dataset(entry):
            continue
        elif not kind_of(entry)[0]:
            here[left_suffix(entry)] += 1
        elif holds_nothing(entry):
            here[EMPTY] += 1
        else:
            found.append(_input_for(entry, str(entry)))
    if not found:
        held = ", ".join(f"{kind} {n:,}" for kind, n in here.most_common(4)) or "nothing"
        advice = "point --data at the text"
        if here[BROKEN_LINK]:
            advice = LINKS_ADVICE
        elif here[LINKED_FOLDER]:
            advice = LINKED_ADVICE
        elif any(kind not in UNREADABLE for kind in here):
            advice = _plain_text_advice(
                here,
                f"to read its files as plain text, name them with a glob: --data '{folder}/**/*",
            )
        raise GpuflowError(f"folder {folder} holds no {_supported()} ({held}); {advice}")
    left_out.update(here)
    return found


def left_suffix(path: Path) -> str:
    """How a file left out is counted: its last two suffixes, lower case."""
    return "".join(path.suffixes[-2:]).lower() or "no suffix"


def describe_left_out(left_out: Counter[str]) -> str:
    """One line on the files of the folders and globs given that are not read: empty, or of
    no kind read here, by their suffixes."""
    files = sum(left_out.values())
    # The common kinds, and always what the advice below is about (links to nothing).
    shown = [kind for kind, _ in left_out.most_common(4)]
    shown += [kind for kind in (BROKEN_LINK, LINKED_FOLDER) if left_out[kind] and kind not in shown]
    common = ", ".join(f"{kind} {left_out[kind]:,}" for kind in shown)
    more = ", ..." if len(left_out) > len(shown) else ""
    many = f"{files:,} file{'s' if files != 1 else ''} of those given " + (
        "are" if files != 1 else "is"
    )
    if left_out[BROKEN_LINK]:
        return f"note: {many} left out ({common}{more}); {FETCH} to read them"
    if left_out[LINKED_FOLDER]:
        return f"note: {many} left out ({common}{more}); {LINKED_ADVICE}"
    if set(left_out) <= {EMPTY, SAME_FILE}:
        what = " or ".join(
            w for w, kind in (("empty", EMPTY), ("another name of a file read once", SAME_FILE))
            if left_out[kind]
        )  # fmt: skip
        return f"note: {many} {what} and left out"
    if all(kind in (*UNREADABLE, SAME_FILE) for kind in left_out):
        return f"note: {many} left out ({common}{more}): prepare reads regular files only"
    why = "empty or of no kind prepare reads" if EMPTY in left_out else "of no kind prepare reads"
    advice = _plain_text_advice(
        left_out, "to read such files as plain text, name them, as a glob does: --data 'FOLDER/**/*"
    )
    return f"note: {many} left out, {why} ({common}{more}); {advice}"


def _plain_text_advice(left_out: Counter[str], glob_advice: str) -> str:
    """How to read files left out for their suffix: ``glob_advice``, which ends where the
    suffix goes, except for JSON, CSV and TSV, which a glob would have refused."""
    suffix = _example_suffix(left_out)
    if suffix == ".EXT" and any(kind in STRUCTURED for kind in left_out):
        names = "/".join(STRUCTURED[k] for k in STRUCTURED if left_out[k])
        return (
            f"{names} files are read only as documents in .jsonl or .parquet (the text in "
            "--text-field): their syntax would be trained on as text"
        )
    return f"{glob_advice}{suffix}'"


def separator_unseen(separator: str | None, inputs: list[Input], documents: int) -> str | None:
    """A note where ``--separator`` was given, every input is a text file and each made one
    document: the separator occurs in none of them (a typo, or an escape the shell kept)."""
    if separator is None or not inputs or any(i.kind != "text" for i in inputs):
        return None
    if documents > len(inputs):
        return None
    crlf = "; Windows line ends need \\r\\n in it" if "\n" in separator else ""
    return (
        f"note: --separator {separator!r} occurs in none of the text files given, so each is one "
        f"document; check it (of escapes, only \\n, \\r, \\t and \\\\ are read as such{crlf})"
    )


def _example_suffix(left_out: Counter[str]) -> str:
    """The most common suffix left out that a glob can name (".py"), else ".EXT"."""
    for kind, _ in left_out.most_common():
        if kind.startswith(".") and kind.count(".") == 1 and kind not in STRUCTURED:
            return kind
    return ".EXT"


def _input_for(path: Path, given: str) -> Input:
    if is_dataset_folder(path):
        return Input(path, "dataset")
    if not path.is_file():  # a pipe (what a shell's <(command) names) or a device
        raise GpuflowError(
            f"corpus path {given} is a pipe or a device, not a file, and prepare reads its "
            "files twice (the tokenizer's sample, then all of them); write the text to a "
            "file, or pipe it to standard input: COMMAND | gpuflow prepare --data - ..."
        )
    suffix, compression = _suffix_and_compression(path)
    kind = KINDS.get(suffix)
    if kind is None:
        if suffix in STRUCTURED:
            raise GpuflowError(
                f"corpus file {given} is {STRUCTURED[suffix]}, whose syntax would be trained on "
                f"as text; give its documents as .jsonl or .parquet (the text in --text-field), "
                f"or rename it to .txt to train on it as it is"
            )
        kind = "text"  # source code, .rst, a README: read as the text it is
    if compression == "zstd":
        require_extra("zstandard", "zstd", f"{given} is zstd-compressed")
        check_zstd_frames(path, given)
    if kind == "parquet":
        require_extra("pyarrow", "parquet", f"{given} is a Parquet file")
    if not os.access(path, os.R_OK):
        raise GpuflowError(f"corpus file {given} is not readable; check its permissions")
    return Input(path, kind, compression)


def require_extra(module: str, extra: str, why: str) -> Any:
    """``module``, imported; if it is not installed, the error says which extra brings it."""
    try:
        return __import__(module)
    except ImportError:
        raise GpuflowError(f"{why}, which needs {module}: pip install 'gpuflow[{extra}]'") from None
