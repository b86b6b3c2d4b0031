"""Corpora as a stream of text parts, read in bounded blocks whatever their format.

``inputs.resolve_inputs`` finds the inputs among files, folders, globs and ``-`` (standard
input): text, JSON lines, Parquet, any of them compressed, and folders saved by ``datasets``.
``read_parts`` yields ``Part`` s: the text of one document comes in one or more consecutive
parts, the first marked ``starts_document``. Bad input is a ``GpuflowError`` naming the file
and, where it helps, the byte offset, line or row.

Each format, its extra and how it is read, and what a part carries:
docs/architecture/data.md (Reading a corpus).
"""

from __future__ import annotations

import codecs
import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError, first_line
from gpuflow.data.prepare.inputs import Input, require_extra
from gpuflow.data.prepare.streams import opened

READ_BYTES = 1 << 20  # one read of a text file: what a part of a long document holds at most


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


# Byte-order marks of the wider Unicode encodings, with the name iconv reads them by (its
# byte order from the mark), the 32-bit ones first (UTF-32-LE's starts with UTF-16-LE's).
_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32LE", "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32BE", "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16LE", "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16BE", "UTF-16"),
)  # fmt: skip


def _wide_encoding(head: bytes) -> tuple[str, str] | None:
    """The wider Unicode encoding whose byte-order mark ``head`` starts with, if any, and
    its name for iconv."""
    return next((names for mark, *names in _WIDE_BOMS if head.startswith(mark)), None)


def _wide_error(name: str, wide: tuple[str, str]) -> str:
    """A file in a wider Unicode encoding (as Windows tools write text), and its conversion."""
    encoding, family = wide
    path = Path(name)
    converted = str(path.with_name(f"{path.stem}.utf8{path.suffix}"))
    return (
        f"corpus file {name} is {encoding} text (it starts with a {encoding} byte-order mark), "
        f"not UTF-8; convert it: iconv -f {family} -t UTF-8 {shlex.quote(name)} > "
        f"{shlex.quote(converted)}"
    )


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
            if offset == 0 and (wide := _wide_encoding(block)):
                raise GpuflowError(_wide_error(inp.name, wide)) from None
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
            if line_no == 1 and (wide := _wide_encoding(line)):
                raise GpuflowError(_wide_error(inp.name, wide)) from None
            raise GpuflowError(
                f"{inp.name}:{line_no} is not UTF-8 text (bad byte at column {exc.start + 1}); "
                "convert the file to UTF-8"
            ) from None
        except json.JSONDecodeError as exc:
            raise GpuflowError(
                f"{inp.name}:{line_no} is not valid JSON ({exc.msg}); each line must be one object"
            ) from None
        except (ValueError, RecursionError) as exc:  # a number of >4300 digits, deep nesting
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise GpuflowError(
                f"{inp.name}:{line_no} cannot be read as JSON ({reason.split(':')[0]}); fix or "
                "remove that line"
            ) from None
        value = record.get(field) if isinstance(record, dict) else None
        null = value is None and isinstance(record, dict) and field in record
        if not isinstance(value, str) and not null:
            raise GpuflowError(
                f"{inp.name}:{line_no} has no string field {field!r}; each line must look like "
                f'{{"{field}": "..."}}' + ("" if field != "text" else ", or pass --text-field")
            )
        if null:  # a missing value (a table's null, exported): no text, as in Parquet
            continue
        if "\x00" in value:
            raise GpuflowError(f"{inp.name}:{line_no} holds a NUL character; pass only text")
        if _has_lone_surrogate(value):
            raise GpuflowError(
                f"{inp.name}:{line_no} holds a lone surrogate (such as \\ud800), which is no "
                "character of text; fix or remove that line"
            )
        if value.strip():
            raw = position()
            yield Part(value, True, raw - raw_seen)
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
        if pa.types.is_dictionary(column.type):  # a pandas categorical: its values are text
            column = column.dictionary_decode()
        if _is_string_view(pa, column.type):  # text too, in Arrow's other layout
            column = column.cast(pa.string())
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


def _is_string_view(pa: Any, arrow_type: Any) -> bool:
    """Whether ``arrow_type`` is Arrow's string view (pyarrow 16 and later write it)."""
    is_view = getattr(pa.types, "is_string_view", None)
    return bool(is_view and is_view(arrow_type))


def _next_batch(inp: Input, batches: Iterator[Any], rows: int) -> Any:
    """The next of ``batches`` (None: no more), with a read that fails (damaged pages, a file
    cut short, a disk error) made one line naming the input; ``rows``: those read so far."""
    import pyarrow as pa

    try:
        return next(batches, None)
    except (pa.ArrowException, OSError) as exc:
        raise GpuflowError(
            f"corpus file {inp.name} cannot be read past row {rows:,} ({first_line(exc)}); it is "
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
    datasets = require_extra("datasets", "datasets", f"{inp.name} is a dataset folder")
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
