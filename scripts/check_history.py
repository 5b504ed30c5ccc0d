"""Fail when the tree narrates how the work was organized instead of stating what the code does.

    python3 scripts/check_history.py            # exit 1 and list every hit
    python3 scripts/check_history.py --list     # print the rules

The project speaks of itself: docstrings and comments state rules, math, layouts, invariants and bounds;
measured figures live in BENCHMARKS.md (generated) and history in CHANGELOG.md.  What this looks for
(:data:`RULES`): work sessions and ordinal runs ("the fifth session", "call 5", "run B", "rerun2"), paths of
run artifacts that left the tree (``tools/exp``, ``docs/data``), experiment script names (``s12_ab``), scripts
and switches that are archived (``decode_sweep``, ``kernel-notes``, ``SPARSEMLA_WS``, ...),
references to numbered BENCHMARKS sections or tables, issue numbers, who-did-what names of the workers
(``H1``-``H5``, "the lead"), before/after narration of figures ("was 72 us", "153 -> 120 us"), and dates
inside the package's code.

Scanned: the package, tests, docs, benchmarks (not the results data, whose rows carry provenance by
design), scripts, README.md, BENCHMARKS.md, pyproject.toml, .ci/run.  CHANGELOG.md is a history by
definition: only the session rules apply to it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Iterator, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ORD = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
        "fourteenth|fifteenth|1st|2nd|3rd|[4-9]th|1[0-9]th")

# (name, regex, where): where = "all" (every scanned file, CHANGELOG included), "tree" (not CHANGELOG),
# "package" (sparsemla/ only).
RULES: List[Tuple[str, "re.Pattern", str]] = [
    # "session" as a word (not pytest's scope="session" or pytest_sessionstart)
    ("session", re.compile(r"(?<![\w\"'])sessions?(?!\w)(?![\"'])", re.I), "all"),
    ("ordinal run", re.compile(rf"\b(?:{_ORD})[- ](?:session|device call|device run)s?\b", re.I), "all"),
    ("numbered call", re.compile(r"\bcall \d+\b"), "tree"),
    ("run letter", re.compile(r"\b(?:run|Run|rerun) [A-H](?=\s*[),.;:]|\s*$)"), "tree"),
    ("numbered run", re.compile(r"\b(?:re)?run\d+\b"), "tree"),
    ("artifact path", re.compile(r"\btools/exp\b|\bdocs/data\b"), "tree"),
    ("archived script", re.compile(r"\b(?:bench_movement|decode_sweep|few_sweep|small_sweep|ws_sweep|peer_kernels|"
                                   r"prefill_runner|profile_one|gpu_bench)\b|accuracy_report\.py|kernel-notes|"
                                   r"SPARSEMLA_WS\b"), "tree"),
    ("experiment script", re.compile(r"\bs\d{1,2}_(?:ab|run\d*|final|small|pdl|f8|cli)\w*"), "tree"),
    ("BENCHMARKS section", re.compile(r"BENCHMARKS(?:\.md)?,? (?:sections?|tables?|§) ?\d+|\bsections? \d+[a-c]?\b", re.I),
     "tree"),
    ("old table number", re.compile(r"\btables? \d+[a-c]\b"), "tree"),
    ("issue number", re.compile(r"(?<![/\w#])issues? #?\d+\b", re.I), "tree"),
    ("worker name", re.compile(r"\bH[1-5]\b|\bthe lead\b"), "tree"),
    ("before/after figure", re.compile(r"\bwas (?:~|about )?\d+(?:\.\d+)? ?(?:us|ms|TFLOP/s|%)"
                                       r"|\d(?:\.\d+)? ?(?:us |ms )?-> ?\d+(?:\.\d+)? ?(?:us|ms|TFLOP/s|%)(?!\w)"), "tree"),
    ("date in code", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "package"),
]

SCAN = ["sparsemla", "tests", "docs", "benchmarks", "scripts", "README.md", "BENCHMARKS.md", "CHANGELOG.md",
        "pyproject.toml", ".ci/run"]
SKIP_DIRS = {"__pycache__", "results"}
SKIP_FILES = {os.path.join("scripts", "check_history.py")}
TEXT_EXT = (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", "")


def files(root: str = ROOT) -> Iterator[str]:
    for entry in SCAN:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            yield entry
        elif os.path.isdir(path):
            for d, subdirs, names in os.walk(path):
                subdirs[:] = sorted(s for s in subdirs if s not in SKIP_DIRS and not s.startswith("."))
                for n in sorted(names):
                    rel = os.path.relpath(os.path.join(d, n), root)
                    if rel not in SKIP_FILES and os.path.splitext(n)[1] in TEXT_EXT:
                        yield rel


def check_text(rel: str, text: str) -> List[Tuple[int, str, str]]:
    """(line number, rule, line) for every hit in one file's text."""
    changelog = os.path.basename(rel) == "CHANGELOG.md"
    package = rel.split(os.sep)[0] == "sparsemla"
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, rx, where in RULES:
            if where == "tree" and changelog or where == "package" and not package:
                continue
            if rx.search(line):
                hits.append((n, name, line.strip()))
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the rules and exit")
    ap.add_argument("--root", default=ROOT)
    a = ap.parse_args(argv)
    if a.list:
        for name, rx, where in RULES:
            print(f"{name:20s} [{where}] {rx.pattern}")
        return 0
    total = 0
    for rel in files(a.root):
        try:
            text = open(os.path.join(a.root, rel), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        for n, name, line in check_text(rel, text):
            total += 1
            print(f"{rel}:{n}: [{name}] {line[:160]}")
    if total:
        print(f"check_history: {total} hit(s): state what the code does; history goes to CHANGELOG.md, "
              "figures to the results file")
        return 1
    print("check_history: no narration of how the work was organized")
    return 0


if __name__ == "__main__":
    sys.exit(main())
