"""The corpus to prepare: the user's inputs, or the built-in one, the documentation inside
Python itself.

The built-in corpus needs no download and no file in this repository: it is built at run time
from the standard library's documentation topics (``pydoc_data``) and the docstrings of its
modules, read from source with ``ast`` so that no module is imported. (The user's corpora are
read by ``gpuflow.data.prepare.formats``.)
"""

from __future__ import annotations

import ast
import itertools
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.formats import Part, ReadOptions, read_parts
from gpuflow.data.prepare.inputs import Input, resolve_inputs

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


class Corpus:
    """The documents to tokenize as parts: the user's inputs, or the built-in corpus."""

    def __init__(self, paths: tuple[str, ...], options: ReadOptions) -> None:
        self.options = options
        self.left_out: Counter[str] = Counter()  # files of the folders given not read, by suffix
        # (resolve_inputs finds at least one input for any paths, or refuses them)
        self.inputs: list[Input] = resolve_inputs(list(paths), self.left_out) if paths else []
        if paths:
            sizes = [i.size() for i in self.inputs]
            self.total_bytes = None if None in sizes else sum(s for s in sizes if s is not None)
            self.description = ", ".join(paths)
            self._builtin = None
        else:
            self._builtin = default_corpus()
            self.total_bytes = sum(d.size for d in self._builtin)
            self.description = f"built-in (Python {sys.version.split()[0]} docs and docstrings)"
        self._stdin_head: list[Part] = []  # standard input read while sampling, given again
        self._stdin_rest: Iterator[Part] | None = None

    @property
    def rereadable(self) -> bool:
        return all(i.path is not None for i in self.inputs)

    def identity(self) -> list[Any]:
        if self._builtin is not None:
            return ["builtin", sys.version.split()[0], self.total_bytes]
        return [i.identity() for i in self.inputs]

    def check_unchanged(self, identity: list[Any]) -> None:
        """Refuse a corpus whose files changed since ``identity`` was taken (before they
        were read): what was read is then in neither version of a file."""
        for inp, now, then in zip(self.inputs, self.identity(), identity, strict=False):
            if now != then:
                raise GpuflowError(
                    f"{inp.name} changed while it was read (its size or modification time "
                    "moved); nothing was written: run again once it stops changing"
                )

    def parts(self) -> Iterator[Part]:
        if self._builtin is not None:
            yield from (Part(d.text, True, d.size) for d in self._builtin)
            return
        for inp in self.inputs:
            if inp.path is None:
                yield from self._stdin_head
                self._stdin_head = []
                yield from self._stdin_parts(inp)
            else:
                yield from read_parts(inp, self.options)

    def _stdin_parts(self, inp: Input) -> Iterator[Part]:
        if self._stdin_rest is None:
            self._stdin_rest = read_parts(inp, self.options)
        return self._stdin_rest

    def sample(self, chars: int) -> Iterator[str]:
        """About ``chars`` characters of text drawn evenly from the corpus (standard input:
        its first ``chars``, held to be encoded later and to be sampled again). Every input
        is read through, so a bad file is found before anything is written."""
        if not self.rereadable:
            stdin = next(i for i in self.inputs if i.path is None)

            def read_on() -> Iterator[Part]:
                for part in self._stdin_parts(stdin):
                    self._stdin_head.append(part)  # held to be encoded, or sampled again
                    yield part

            taken = 0
            for part in itertools.chain(list(self._stdin_head), read_on()):
                taken += len(part.text)
                yield part.text
                if taken >= chars:
                    return
            return
        # Error diffusion over the parts: a part is taken when the credit its share of the
        # sample has built up allows, so what is taken spreads evenly over the corpus. The
        # corpus's size in characters is estimated from what has been read (compressed
        # inputs hold several characters per byte on disk).
        # Long parts are drawn from a slice at a time, so a sample far smaller than one
        # document still spreads over it.
        total, step = self.total_bytes or 1, max(4096, chars // 256)
        credit, seen_bytes, seen_chars = 0.0, 0, 0
        for part in self.parts():
            seen_bytes, seen_chars = seen_bytes + part.size, seen_chars + len(part.text)
            expected = max(chars, total * seen_chars / max(seen_bytes, 1))
            for start in range(0, len(part.text), step):
                piece = part.text[start : start + step]
                credit += len(piece) * chars / expected
                if credit > 0:
                    credit -= len(piece)
                    yield piece
