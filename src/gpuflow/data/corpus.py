"""Where training text comes from: the user's files, or the documentation inside Python itself.

User corpora are ``.txt`` and ``.md`` files (one document each), ``.jsonl`` files (one
document per line, in its ``text`` field), and folders of them. The default corpus needs no
download and no file in this repository: it is built at run time from the standard
library's documentation topics (``pydoc_data``) and the docstrings of its modules, read
from source with ``ast`` so that no module is imported.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuflow.common.errors import GpuflowError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
CORPUS_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES

# Parts of the standard library that are tests, demos or vendored trees rather than
# documented modules.
_SKIPPED_STDLIB_PARTS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "pydoc_data",
        "__pycache__",
        "__phello__",
    }
)


@dataclass(frozen=True)
class Document:
    source: str
    text: str
    # Source bytes this document accounts for; a corpus's documents sum to its size on disk,
    # so progress counted in them ends exactly at the total.
    size: int


def resolve_corpus_files(paths: list[str | Path]) -> list[Path]:
    """Expand folders and check every file before anything is read or written."""
    if not paths:
        raise GpuflowError(
            "no corpus given; pass --data FILE_OR_FOLDER (or leave it out for the built-in corpus)"
        )
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise GpuflowError(f"corpus path {path} does not exist; check the --data argument")
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES
            )
            if not found:
                raise GpuflowError(
                    f"folder {path} holds no {', '.join(CORPUS_SUFFIXES)} files; "
                    "point --data at the text files"
                )
            files.extend(found)
        elif path.suffix.lower() in CORPUS_SUFFIXES:
            files.append(path)
        else:
            raise GpuflowError(
                f"corpus file {path} has an unsupported type {path.suffix or '(none)'}; "
                f"use {', '.join(CORPUS_SUFFIXES)} files"
            )
    for path in files:
        if path.stat().st_size == 0:
            raise GpuflowError(f"corpus file {path} is empty; remove it or add text to it")
    return files


def _read_utf8(path: Path) -> tuple[str, int]:
    """The file's text without a byte-order mark, and its size in bytes."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GpuflowError(
            f"corpus file {path} is not UTF-8 text (bad byte at offset {exc.start}); "
            "convert it to UTF-8 or leave it out"
        ) from None
    if "\x00" in text:
        raise GpuflowError(
            f"corpus file {path} is binary (it contains NUL bytes); pass only text files"
        )
    if not text.strip():
        raise GpuflowError(f"corpus file {path} holds only whitespace; remove it or add text")
    return text.removeprefix("\ufeff"), len(data)


def _jsonl_lines(text: str) -> Iterator[tuple[str, int]]:
    """Lines split at newlines only (JSON strings may hold U+2028 and other line breaks
    that ``str.splitlines`` would cut at), each with its UTF-8 size including the newline."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end + 1
        line = text[start:end]
        yield line, len(line.encode("utf-8"))
        start = end


def _jsonl_documents(path: Path, text: str, size: int) -> Iterator[Document]:
    held: Document | None = None  # yielded once the next one is found: the last takes the rest
    pending = 0  # bytes of the lines read since the last document
    yielded = 0
    for line_no, (line, line_bytes) in enumerate(_jsonl_lines(text), start=1):
        pending += line_bytes
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GpuflowError(
                f"{path}:{line_no} is not valid JSON ({exc.msg}); each line must be one object"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise GpuflowError(
                f"{path}:{line_no} has no string field 'text'; each line must look like "
                '{"text": "..."}'
            )
        if record["text"].strip():
            if held is not None:
                yield held
                yielded += held.size
            held, pending = Document(f"{path}:{line_no}", record["text"], pending), 0
    if held is None:
        raise GpuflowError(f"corpus file {path} has no non-empty 'text' field on any line")
    # Skipped lines count towards the next document and the last one takes what remains (a
    # byte-order mark, trailing blank lines), so the file's documents sum to its size.
    yield Document(held.source, held.text, size - yielded)


def iter_documents(files: list[Path]) -> Iterator[Document]:
    """Documents in a fixed order: files as given (folders sorted), lines in file order."""
    for path in files:
        text, size = _read_utf8(path)
        if path.suffix.lower() in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text, size)
        else:
            yield Document(str(path), text, size)


def _builtin_document(source: str, text: str) -> Document:
    return Document(source, text, len(text.encode("utf-8")))


def _docstrings(tree: ast.AST) -> Iterator[str]:
    """Module, class and function docstrings, in source order, skipping nested expressions."""
    stack = [tree]
    while stack:
        node = stack.pop()
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
        children = [
            child
            for child in getattr(node, "body", [])
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        stack.extend(reversed(children))


def _stdlib_module_documents() -> Iterator[Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if _SKIPPED_STDLIB_PARTS.intersection(relative.parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue  # a broken or unreadable file in the install is not the user's problem
        text = "\n\n".join(_docstrings(tree))
        if len(text) >= 200:
            yield _builtin_document(f"stdlib:{relative.as_posix()}", text)


def default_corpus() -> list[Document]:
    """The built-in corpus: about 2 MB of English technical prose on CPython 3.11.

    Its exact content follows the running Python version; ``prepare`` records a summary.
    """
    documents: list[Document] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data into a separate package
        topics = {}
    for name in sorted(topics):
        if topics[name].strip():
            documents.append(_builtin_document(f"pydoc:{name}", topics[name]))
    documents.extend(_stdlib_module_documents())
    if not documents:
        raise GpuflowError(
            "this Python ships neither pydoc_data nor readable standard-library sources, so "
            "there is no built-in corpus; pass --data FILE_OR_FOLDER"
        )
    return documents
