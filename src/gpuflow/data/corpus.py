"""The built-in corpus: the documentation inside Python itself.

It needs no download and no file in this repository: it is built at run time from the
standard library's documentation topics (``pydoc_data``) and the docstrings of its modules,
read from source with ``ast`` so that no module is imported. (The user's corpora are read
by ``gpuflow.data.formats``.)
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuflow.common.errors import GpuflowError

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
