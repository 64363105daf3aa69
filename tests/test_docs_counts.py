"""Every count of tests, files, flags, modules, scripts or model families the README and docs/ state is one the code produces.

A count written by hand ("36 GPU tests") goes stale as soon as a test is added; so the docs state none
but those this module derives (`DERIVED`: each phrase with the function that counts it), and a count
it cannot derive fails here, naming the page and line: drop the number, or derive it in DERIVED. The
GPU tests are counted by pytest's own collection (`-m cuda`), which runs only when a page states
such a count (it takes ~20 s).
"""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phantom.arch.family import FAMILIES

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                    "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
NOUNS = r"test files|test modules|tests?|files|flags|options|modules|scripts|checks|famil(?:y|ies)"
# a number (digits, or a number word from two up), at most two words, then what is counted; not a path
# (`8 scripts/finetune.py`), not an assignment (`OMP_NUM_THREADS=1 python scripts/...`), not "one of"
COUNT = re.compile(rf"(?<![\w=.-])(\d[\d,]*|{'|'.join(w for w in WORDS if WORDS[w] > 1)})\s+"
                   rf"((?:(?!of\b)[A-Za-z-]+\s+){{0,2}}?)({NOUNS})\b(?![/.\w-])", re.IGNORECASE)


@functools.cache
def collected(marker: str) -> int:
    """Tests pytest collects under tests/ with `-m marker`."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, "tests"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    return int(m.group(1))


DERIVED = {  # a counted phrase (lower case, as the page writes it after the number) -> what counts it
    "gpu tests": lambda: collected("cuda"),
    "cuda tests": lambda: collected("cuda"),
    "families": lambda: len(FAMILIES),  # phantom.arch.family's entries, one a transformers model class (or two)
}


def counts(text: str) -> list[tuple[int, int, str]]:
    """(line number, the number, the counted phrase) of every count in text."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        for m in COUNT.finditer(line):
            number = m.group(1).lower()
            n = WORDS[number] if number in WORDS else int(number.replace(",", ""))
            out.append((no, n, " ".join((m.group(2) + m.group(3)).lower().split())))
    return out


def test_the_scanner_finds_counts_and_not_paths_or_assignments():
    text = ("python3 -m pytest -q -m cuda tests   # 36 GPU tests: streamed == resident\n"
            "torchrun --nproc-per-node 8 scripts/finetune.py; OMP_NUM_THREADS=1 python benchmarks/bench.py\n"
            "one of their files; twelve flags of finetune.py; the 1,204 tests and 3 test files; 2 tests/x.py\n")
    assert counts(text) == [(1, 36, "gpu tests"), (3, 12, "flags"), (3, 1204, "tests"), (3, 3, "test files")]


def test_the_docs_state_no_count_the_code_does_not_produce():
    found = [(page, no, n, what) for page in PAGES for no, n, what in counts(page.read_text())]
    unknown = [f"{page.relative_to(REPO)}:{no}: {n} {what}" for page, no, n, what in found if what not in DERIVED]
    assert not unknown, f"counts nothing derives (drop the number, or derive it in DERIVED): {unknown}"
    wrong = [f"{page.relative_to(REPO)}:{no}: {n} {what}, the code has {DERIVED[what]()}"
             for page, no, n, what in found if DERIVED[what]() != n]
    assert not wrong, wrong


@pytest.mark.parametrize("what", sorted(DERIVED))
def test_each_derived_phrase_is_one_the_scanner_reads(what):
    assert counts(f"there are 5 {what} here") == [(1, 5, what)]
