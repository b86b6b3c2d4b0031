"""Corpora as a stream of text parts, read in bounded blocks whatever their format.

``resolve_inputs`` finds the inputs among files, folders, globs and ``-`` (standard input):
text, JSON lines, Parquet, any of them compressed, and folders saved by ``datasets``.
``read_parts`` yields ``Part`` s: the text of one document comes in one or more consecutive
parts, the first marked ``starts_document``. Bad input is a ``GpuflowError`` naming the file
and, where it helps, the byte offset, line or row.

Each format, its extra and how it is read, and what a part carries:
docs/architecture/data.md (Reading a corpus).
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.streams import check_zstd_frames, opened

READ_BYTES = 1 << 20  # one read of a text file: what a part of a long document holds at most
KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
# What a dataset folder written by ``datasets``' save_to_disk holds.
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")


@dataclass(frozen=True)
class Part:
    text: str
    starts_document: bool
    size: int  # source bytes read for this part


@dataclass(frozen=True)
class ReadOptions:
    separator: str | None = None  # text files: documents between these (None: one per file)
    text_field: str = "text"  # JSON lines, Parquet and datasets: the column with the text

    def __post_init__(self) -> None:
        if self.separator is not None and not self.separator:
            raise GpuflowError("--separator must not be empty; leave it out for one per file")
        if not self.text_field:
            raise GpuflowError("--text-field must name a field")


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


# ---- finding the inputs -------------------------------------------------------------------


def kind_of(path: Path) -> tuple[str | None, str | None]:
    """(format, compression) from a file's suffixes; format None: not a corpus file."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    return (KINDS.get(suffixes[-1]) if suffixes else None), compression


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
    suffixes (``left_suffix``)."""
    if not paths:
        raise GpuflowError(
            "no corpus given; pass --data FILE_OR_FOLDER (or leave it out for the built-in corpus)"
        )
    inputs: list[Input] = []
    left_out = Counter() if left_out is None else left_out
    for raw in paths:
        try:
            inputs.extend(_inputs_named(str(raw), left_out))
        except PermissionError as exc:  # a folder it may not look into, on the way or inside
            raise GpuflowError(
                f"cannot read {exc.filename or raw} (permission denied), from --data {raw}; "
                "check its permissions, or leave it out"
            ) from None
    if sum(i.path is None for i in inputs) > 1:
        raise GpuflowError("- (standard input) can be read once: name it once in --data")
    for inp in inputs:
        if inp.path is not None and inp.kind != "dataset" and inp.path.stat().st_size == 0:
            raise GpuflowError(f"corpus file {inp.path} is empty; remove it or add text to it")
    return inputs


def _inputs_named(raw: str, left_out: Counter[str]) -> list[Input]:
    """The inputs one --data argument names: standard input, a glob's matches, a file or a
    folder."""
    if raw == "-":
        return [Input(None, "text")]
    path = Path(raw)
    if not path.exists() and any(ch in raw for ch in "*?["):
        matched = sorted(Path(p) for p in glob.glob(raw, recursive=True))
        if not matched:
            raise GpuflowError(f"no file matches {raw}; check the --data pattern")
        # What it matches counts as if each were named: a folder is read whole.
        return [i for p in matched for i in _inputs_of(p, str(p), left_out)]
    if not path.exists():
        raise GpuflowError(f"corpus path {path} does not exist; check the --data argument")
    return _inputs_of(path, raw, left_out)


def _inputs_of(path: Path, given: str, left_out: Counter[str]) -> list[Input]:
    if path.is_dir() and not is_dataset_folder(path):
        return _folder_inputs(path, left_out)
    return [_input_for(path, given)]


def _folder_inputs(folder: Path, left_out: Counter[str]) -> list[Input]:
    found: list[Input] = []
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
        elif not entry.is_file() or inside_dataset(entry):
            continue
        elif kind_of(entry)[0]:
            found.append(_input_for(entry, str(entry)))
        else:
            left_out[left_suffix(entry)] += 1
    if not found:
        raise GpuflowError(f"folder {folder} holds no {_supported()}; point --data at the text")
    return found


def left_suffix(path: Path) -> str:
    """How a file left out is counted: its last two suffixes, lower case."""
    return "".join(path.suffixes[-2:]).lower() or "no suffix"


def describe_left_out(left_out: Counter[str]) -> str:
    """One line on the files of the folders given that are not read, by their suffixes."""
    files = sum(left_out.values())
    common = ", ".join(f"{kind} {n:,}" for kind, n in left_out.most_common(4))
    more = ", ..." if len(left_out) > 4 else ""
    return (
        f"note: {files:,} file{'s' if files != 1 else ''} in the folders given "
        f"{'are' if files != 1 else 'is'} of no kind prepare reads and left out "
        f"({common}{more}); to include a plain-text file, copy or rename it to .txt (.txt.gz "
        "and the like if compressed)"
    )


def _input_for(path: Path, given: str) -> Input:
    if is_dataset_folder(path):
        return Input(path, "dataset")
    kind, compression = kind_of(path)
    if kind is None:
        raise GpuflowError(
            f"corpus file {given} has an unsupported type {''.join(path.suffixes) or '(none)'}; "
            f"use {_supported()}"
        )
    if compression == "zstd":
        _require("zstandard", "zstd", f"{given} is zstd-compressed")
        check_zstd_frames(path, given)
    if kind == "parquet":
        _require("pyarrow", "parquet", f"{given} is a Parquet file")
    if not os.access(path, os.R_OK):
        raise GpuflowError(f"corpus file {given} is not readable; check its permissions")
    return Input(path, kind, compression)


def _require(module: str, extra: str, why: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise GpuflowError(f"{why}, which needs {module}: pip install 'gpuflow[{extra}]'") from None


# ---- reading ----------------------------------------------------------------------------


def read_parts(inp: Input, options: ReadOptions) -> Iterator[Part]:
    """``inp``'s documents as parts (see the module docstring)."""
    if inp.kind == "parquet":
        yield from _parquet_parts(inp, options)
    elif inp.kind == "dataset":
        yield from _dataset_parts(inp, options)
    else:
        with opened(inp) as (stream, position):
            if inp.kind == "jsonl":
                yield from _jsonl_parts(inp, stream, position, options)
            else:
                yield from _text_parts(inp, stream, position, options)


def _decoded_blocks(inp: Input, stream: Any, position: Any) -> Iterator[tuple[str, int]]:
    """(text, raw bytes read for it) of each block, strict UTF-8, a leading BOM dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset, raw_seen, first = 0, 0, True
    while True:
        block = stream.read(READ_BYTES)
        final = not block
        pending = len(decoder.getstate()[0])
        try:
            text = decoder.decode(block, final=final)
        except UnicodeDecodeError as exc:
            at = offset - pending + exc.start
            raise GpuflowError(
                f"corpus file {inp.name} is not UTF-8 text (bad byte at offset {at}); convert "
                "it to UTF-8 or leave it out"
            ) from None
        if first and text:
            text, first = text.removeprefix("\ufeff"), False
        if "\x00" in text:
            raise GpuflowError(
                f"corpus file {inp.name} is binary (it contains NUL bytes); pass only text files"
            )
        offset += len(block)
        raw = position()
        yield text, raw - raw_seen
        raw_seen = raw
        if final:
            return


def _text_parts(inp: Input, stream: Any, position: Any, options: ReadOptions) -> Iterator[Part]:
    documents = _separated if options.separator is not None else _whole
    found = False
    for part in documents(_decoded_blocks(inp, stream, position), options.separator or ""):
        found = found or part.starts_document
        yield part
    if not found:
        raise GpuflowError(f"corpus file {inp.name} holds only whitespace; remove it or add text")


def _whole(blocks: Iterator[tuple[str, int]], separator: str) -> Iterator[Part]:
    """The file is one document, as it is; nothing until its first non-whitespace character
    (a file of whitespace is no document)."""
    held, size, started = "", 0, False
    for text, read in blocks:
        held, size = held + text, size + read
        if not started and not held.strip() and len(held) <= READ_BYTES:
            continue
        if held or size:
            yield Part(held, not started, size)
            started = True
            held, size = "", 0


def _separated(blocks: Iterator[tuple[str, int]], separator: str) -> Iterator[Part]:
    """Documents between separators, without the whitespace around them; empty ones skipped.
    A document longer than a block streams through in parts; a separator cut by a block
    boundary is found all the same."""
    carry, size = "", 0
    in_document = False  # a part of the current document has been given out
    for text, read in blocks:
        carry, size = carry + text, size + read
        pieces = carry.split(separator)
        for finished in pieces[:-1]:
            body = finished.rstrip() if in_document else finished.strip()
            if body:
                yield Part(body, not in_document, size)
                size = 0
            in_document = False
        carry = pieces[-1]
        # What may still be the start of a separator, or whitespace that may end the
        # document, stays; the rest of a long document goes now.
        keep = len(carry[: max(0, len(carry) - (len(separator) - 1))].rstrip())
        if keep > READ_BYTES // 2 or (keep and len(carry) > READ_BYTES):
            body = carry[:keep] if in_document else carry[:keep].lstrip()
            if body:
                yield Part(body, not in_document, size)
                size, in_document = 0, True
            carry = carry[keep:]
    body = carry.rstrip() if in_document else carry.strip()
    if body:
        yield Part(body, not in_document, size)
    elif size:
        yield Part("", False, size)  # no text, but its bytes are accounted for


def _has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds half of a UTF-16 surrogate pair without the other: JSON's
    "\\ud800" decodes to one (and so do its encoded bytes, which json.loads passes), and no
    UTF-8 text can hold it. Every document of the corpus passes here, in the main process:
    strict encoding runs at memory speed where a regex scan does not, and ASCII text is
    answered without reading it."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _jsonl_parts(inp: Input, stream: Any, position: Any, options: ReadOptions) -> Iterator[Part]:
    field, found, line_no, raw_seen = options.text_field, False, 0, 0
    while True:
        line = stream.readline()
        if not line:
            break
        line_no += 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError as exc:
            raise GpuflowError(
                f"{inp.name}:{line_no} is not UTF-8 text (bad byte at column {exc.start + 1}); "
                "convert the file to UTF-8"
            ) from None
        except json.JSONDecodeError as exc:
            raise GpuflowError(
                f"{inp.name}:{line_no} is not valid JSON ({exc.msg}); each line must be one object"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise GpuflowError(
                f"{inp.name}:{line_no} has no string field {field!r}; each line must look like "
                f'{{"{field}": "..."}}' + ("" if field != "text" else ", or pass --text-field")
            )
        if "\x00" in record[field]:
            raise GpuflowError(f"{inp.name}:{line_no} holds a NUL character; pass only text")
        if _has_lone_surrogate(record[field]):
            raise GpuflowError(
                f"{inp.name}:{line_no} holds a lone surrogate (such as \\ud800), which is no "
                "character of text; fix or remove that line"
            )
        if record[field].strip():
            raw = position()
            yield Part(record[field], True, raw - raw_seen)
            raw_seen, found = raw, True
    if not found:
        raise GpuflowError(f"corpus file {inp.name} has no non-empty {field!r} field on any line")
    end = position()
    if end > raw_seen:
        yield Part("", False, end - raw_seen)  # trailing lines: their bytes are accounted for


def _string_rows(
    inp: Input, batches: Iterator[Any], field: str, total_size: int, total_rows: int, where: str
) -> Iterator[Part]:
    """Parts of string rows from Arrow record batches of one column."""
    import pyarrow as pa

    row, given, found = 0, 0, False
    while (batch := _next_batch(inp, batches, row)) is not None:
        column = batch.column(0)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise GpuflowError(
                f"{inp.name}: {where} {field!r} holds {column.type}, not text; pass "
                "--text-field with a string column"
            )
        for value in column.to_pylist():
            row += 1
            if value and value.strip():
                if "\x00" in value:
                    raise GpuflowError(f"{inp.name}: row {row} holds a NUL character")
                due = total_size * row // max(total_rows, 1)
                yield Part(value, True, due - given)
                given, found = due, True
    if not found:
        raise GpuflowError(f"{inp.name} has no non-empty text in {where} {field!r}")
    if total_size > given:
        yield Part("", False, total_size - given)


def _next_batch(inp: Input, batches: Iterator[Any], rows: int) -> Any:
    """The next of ``batches`` (None: no more), with a read that fails (damaged pages, a file
    cut short, a disk error) made one line naming the input; ``rows``: those read so far."""
    import pyarrow as pa

    try:
        return next(batches, None)
    except (pa.ArrowException, OSError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise GpuflowError(
            f"corpus file {inp.name} cannot be read past row {rows:,} ({first_line}); it is "
            "damaged or truncated: fetch it again or leave it out"
        ) from None


def _parquet_parts(inp: Input, options: ReadOptions) -> Iterator[Part]:
    import pyarrow.parquet as pq

    field = options.text_field
    assert inp.path is not None
    # Opened here, not by pyarrow: it takes only names that are UTF-8.
    with open(inp.path, "rb") as source:
        try:
            parquet = pq.ParquetFile(source)
        except Exception as exc:  # pyarrow raises ArrowInvalid and others
            raise GpuflowError(f"corpus file {inp.name} is not a Parquet file ({exc})") from None
        names = parquet.schema_arrow.names
        if field not in names:
            raise GpuflowError(
                f"{inp.name} has no column {field!r} (it has {', '.join(names[:8])}); pass "
                "--text-field with the text column"
            )
        batches = iter(parquet.iter_batches(batch_size=1024, columns=[field]))
        total = parquet.metadata.num_rows
        yield from _string_rows(inp, batches, field, inp.size() or 0, total, "column")


def _dataset_parts(inp: Input, options: ReadOptions) -> Iterator[Part]:
    datasets = _require("datasets", "datasets", f"{inp.name} is a dataset folder")
    field = options.text_field
    try:
        loaded = datasets.load_from_disk(str(inp.path))
    except Exception as exc:  # datasets raises FileNotFoundError and its own errors
        raise GpuflowError(f"{inp.name} is not a readable saved dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise GpuflowError(
                f"{inp.name} holds splits {', '.join(loaded)} but no 'train'; save the split "
                "to read with save_to_disk and point --data at it"
            )
        loaded = loaded["train"]
    if field not in loaded.column_names:
        raise GpuflowError(
            f"{inp.name} has no column {field!r} (it has {', '.join(loaded.column_names[:8])}); "
            "pass --text-field with the text column"
        )
    table = loaded.select_columns([field]).with_format("arrow")
    batches = iter(table.iter(batch_size=1024))
    yield from _string_rows(inp, batches, field, inp.size() or 0, loaded.num_rows, "column")
