"""The decision files that code, probes, README and the docs pages cite exist, one per
number, and the index lists every one; every result file in benchmarks/results is named by
one scheme, is cited, and every citation of one names a file that is there."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

DECISIONS = ROOT / "docs" / "decisions"
CITED = re.compile(r"docs/decisions/(\d{3})")
RESULTS = ROOT / "benchmarks" / "results"
# YYYY-MM-DD-<bench>-<preset>-<device>[-<variant>].<ext> (src/gpuflow/bench/results.py): at
# least two words before the device (a probe's bench is probe-<name>), the device as
# device_slug writes it (h100, h200x2, cpu, ...), text output in .txt or .log, a plot in .png
RESULT_NAME = re.compile(
    r"\d{4}-\d{2}-\d{2}-[a-z0-9]+(?:-[a-z0-9]+)+"
    r"-(?:cpu|(?:a|b|h|l|gh|gb|mi)\d+[a-z]*(?:x\d+)?)(?:-[a-z0-9]+)*\.(?:json|txt|log|png)"
)
# a citation: benchmarks/results/NAME, results/NAME or a bare dated NAME, with {a,b}
# alternatives where it stands for several
RESULT_CITATION = re.compile(
    r"(?<![\w/.-])(?:(?:benchmarks/)?results/([\w.{},*-]+)|(\d{4}-\d{2}-\d{2}-[\w.{},*-]+))"
)
RESULT_SUFFIXES = (".json", ".txt", ".log", ".png")


def _numbered() -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for path in DECISIONS.glob("[0-9][0-9][0-9]-*.md"):
        files.setdefault(path.name[:3], []).append(path.name)
    return files


def test_every_cited_decision_is_one_file():
    numbered = _numbered()
    sources = [
        *ROOT.glob("src/**/*.py"),
        *ROOT.glob("benchmarks/probes/*.py"),
        *ROOT.glob("docs/architecture/*.md"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
    ]
    cited = {n for path in sources for n in CITED.findall(path.read_text())}
    assert cited, "nothing cites a decision: the check would pass on anything"
    missing = sorted(n for n in cited if len(numbered.get(n, [])) != 1)
    assert missing == []


def test_the_index_lists_every_decision():
    index = (DECISIONS / "README.md").read_text()
    unlisted = [name for names in _numbered().values() for name in names if name not in index]
    assert unlisted == []


def _citing_sources() -> list[Path]:
    """What may cite a result file: the decisions, the architecture notes, the docs pages,
    README and CHANGELOG, benchmark and probe scripts, the package's comments, the examples
    (a result file citing another does not count)."""
    return [
        *ROOT.glob("docs/decisions/*.md"),
        *ROOT.glob("docs/architecture/*.md"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(p for p in ROOT.glob("benchmarks/**/*.py") if RESULTS not in p.parents),
        *ROOT.glob("src/**/*.py"),
        *(p for p in ROOT.glob("examples/**/*") if p.suffix in (".py", ".md")),
    ]


def _expand(pattern: str) -> list[str]:
    """``a-{b,c}.{json,txt}`` -> the four names it stands for (braces may nest)."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth, parts, begin = 0, [], start + 1
    for i in range(start, len(pattern)):
        if pattern[i] == "{":
            depth += 1
        elif pattern[i] == "}":
            depth -= 1
            if depth == 0:
                parts.append(pattern[begin:i])
                head, tail = pattern[:start], pattern[i + 1 :]
                return [n for part in parts for n in _expand(head + part + tail)]
        elif pattern[i] == "," and depth == 1:
            parts.append(pattern[begin:i])
            begin = i + 1
    return [pattern]  # an unclosed brace: taken as it is, so it names no file


def _result_citations() -> dict[str, list[str]]:
    """Each result file name cited, with the sources that cite it."""
    cited: dict[str, list[str]] = {}
    for path in _citing_sources():
        for match in RESULT_CITATION.finditer(path.read_text()):
            cited_path, bare = match.groups()
            for name in _expand((cited_path or bare).rstrip(".,")):
                if cited_path or name.endswith(RESULT_SUFFIXES):  # a bare date is no file
                    cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return cited


def test_expand_braces():
    assert _expand("2026-11-25-scale-{seed-d384,gpt2-124m}-h100x2.{json,txt}") == [
        "2026-11-25-scale-seed-d384-h100x2.json",
        "2026-11-25-scale-seed-d384-h100x2.txt",
        "2026-11-25-scale-gpt2-124m-h100x2.json",
        "2026-11-25-scale-gpt2-124m-h100x2.txt",
    ]
    assert _expand("a-05{1,{2,3}}.json") == ["a-051.json", "a-052.json", "a-053.json"]


def test_every_result_file_is_named_by_the_scheme():
    names = sorted(p.name for p in RESULTS.iterdir())
    assert names, "no result files: the check would pass on anything"
    assert [n for n in names if not RESULT_NAME.fullmatch(n)] == []


def test_every_result_file_is_cited():
    cited = _result_citations()
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in cited)
    assert uncited == [], "cite these (or delete them)"


def test_every_cited_result_file_exists():
    cited = _result_citations()
    assert cited, "nothing cites a result file: the check would pass on anything"
    missing = {n: where for n, where in sorted(cited.items()) if not (RESULTS / n).is_file()}
    assert missing == {}
