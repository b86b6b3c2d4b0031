"""The decision files that code, probes and README cite exist, one per number, and the
index lists every one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DECISIONS = ROOT / "docs" / "decisions"
CITED = re.compile(r"docs/decisions/(\d{3})")


def _numbered() -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for path in DECISIONS.glob("[0-9][0-9][0-9]-*.md"):
        files.setdefault(path.name[:3], []).append(path.name)
    return files


def test_every_cited_decision_is_one_file():
    numbered = _numbered()
    sources = [*ROOT.glob("src/**/*.py"), *ROOT.glob("benchmarks/probes/*.py"), ROOT / "README.md"]
    cited = {n for path in sources for n in CITED.findall(path.read_text())}
    assert cited, "nothing cites a decision: the check would pass on anything"
    missing = sorted(n for n in cited if len(numbered.get(n, [])) != 1)
    assert missing == []


def test_the_index_lists_every_decision():
    index = (DECISIONS / "README.md").read_text()
    unlisted = [name for names in _numbered().values() for name in names if name not in index]
    assert unlisted == []
