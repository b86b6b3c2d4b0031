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


def test_standard_input_sampled_again_gives_what_it_holds_and_is_encoded_once(monkeypatch):
    """A sample of standard input that is stopped part way (the trainer over its memory) and
    taken again smaller reads the text it holds, not more of the stream; every document is
    then given to the encoder once."""
    import io
    import itertools
    import sys

    from gpuflow.data.prepare.corpus import Corpus
    from gpuflow.data.prepare.formats import ReadOptions

    documents = [f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(60)) for i in range(300)]
    stream = io.BytesIO("\n\n".join(documents).encode())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stream))
    corpus = Corpus(("-",), ReadOptions("\n\n", "text"))
    first = "".join(itertools.islice(corpus.sample(10**9), 40))  # stopped after 40 parts
    read = stream.tell()
    again = "".join(corpus.sample(len(first) // 2))
    assert again == first[: len(again)] and len(first) // 2 <= len(again) < len(first)
    assert stream.tell() == read  # nothing more read from the stream
    encoded: list[str] = []
    for part in corpus.parts():
        if part.starts_document:
            encoded.append("")
        encoded[-1] += part.text
    assert encoded == documents
