"""The built-in corpus: real, deterministic text with its bytes counted."""

from __future__ import annotations

import importlib.util

from gpuflow.data.prepare.corpus import default_corpus


def test_builtin_corpus_is_real_deterministic_text(stdlib_documents):
    assert len(stdlib_documents) > 100
    total = sum(len(d.text) for d in stdlib_documents)
    assert total > 1_000_000  # about 2 MB of prose on CPython 3.11
    sources = [d.source for d in stdlib_documents]
    if importlib.util.find_spec("pydoc_data") is not None:
        assert "pydoc:lists" in sources  # the "lists" documentation topic
    assert any(s == "stdlib:json/__init__.py" for s in sources)
    assert [d.source for d in default_corpus()[:50]] == sources[:50]


def test_builtin_documents_count_their_utf8_bytes(stdlib_documents):
    assert all(d.size == len(d.text.encode("utf-8")) for d in stdlib_documents)
