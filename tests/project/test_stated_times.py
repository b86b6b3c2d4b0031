"""The times the README and the docs state are the ones measured: each is read from the newest
``benchmarks/results/*-newcomer-tiny-cpu.json`` (a fresh clone's `gpuflow train --preset
tiny` and the CPU suite, timed on a 2-core machine), with its date, wherever it is
written."""

from __future__ import annotations

import json

from gpuflow.train.suggest import TINY_ON_CPU
from tests.helpers import ROOT


def _measured() -> dict:
    newest = sorted((ROOT / "benchmarks" / "results").glob("*-newcomer-tiny-cpu.json"))[-1]
    return json.loads(newest.read_text())


def _tiny_phrase(record: dict) -> str:
    return f"about {round(record['tiny_seconds'] / 10) * 10} seconds on 2 CPU cores"


def _suite_phrase(record: dict) -> str:
    return f"about {round(record['suite_seconds'] / 60)} minutes on 2 cores"


def test_the_readme_and_the_docs_state_the_measured_times_and_when():
    record = _measured()
    readme = (ROOT / "README.md").read_text()
    development = (ROOT / "docs" / "development.md").read_text()
    assert _tiny_phrase(record) in readme
    assert _tiny_phrase(record) in TINY_ON_CPU  # what prepare prints after a CPU prepare
    for text in (readme, development):
        assert _suite_phrase(record) in text
        assert f"measured {record['date']}" in text
