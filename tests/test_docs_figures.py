"""Every timing or rate the README and docs/ state is one a test derives or one stated with its source.

A figure measured once ("about 6 minutes") goes stale as the code changes; so each duration (ms, s, minutes,
hours) or rate (GB/s, tokens/s, ...) on a page must either be derived here (`DERIVED`: the phrase, and the value
the code or the page's own arithmetic gives), or sit in a paragraph (a table row on its own) that names where it
was measured: a notes/ file that exists (the lab notebook: command, machine, figures), or a command
(`scripts/NAME.py`) and the machine it ran on (cores, CPU or GPU). A figure with neither fails here, naming the
page and line: give its source, derive it, or drop it. Counts of tests, files and families: tests/test_docs_counts.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from phantom.plan import quickslice

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NUMBER = r"(?<![\w.=/-])~?(\d[\d,]*(?:\.\d+)?)(?:\s*(?:-|to)\s*\d[\d,]*(?:\.\d+)?)?"
DURATION = re.compile(NUMBER + r"\s*(ms|µs|us|s|secs?|seconds?|minutes?|mins?|hours?|h|days?)(?:/step)?(?![\w/]|\.\w)",
                      re.IGNORECASE)
RATE = re.compile(NUMBER + r"\s*((?:[KMGT]i?B|tokens?|tok|TFLOP|GFLOP|it|steps?|rows?)/s)\b", re.IGNORECASE)
NOTE = re.compile(r"notes/([\w.-]+\.md)")
COMMAND = re.compile(r"scripts/[\w/]+\.py")
MACHINE = re.compile(r"\b(\d+-core|cores?|CPUs?|GPUs?|H100|H200|A100|EPYC|Xeon|VM|M[1-4])\b")

# a phrase as the page writes it -> (the value it states, the value the code or the page's arithmetic gives): the
# two must agree within the rounding the page uses (5%)
DERIVED = {
    "takes about 12 s": (12, lambda: quickslice.QUICK_COMPUTE_S),
    "fits in about 48 s": (48, lambda: quickslice.SHORT_ROWS_S),
    # placement.md's worked example: 87 reads of a 1.7 GB block at 3 GB/s, and 142 reads with no RAM tier
    "~50 s at 3 GB/s": (50, lambda: 87 * 1.7 / 3),
    "241 GB, ~80 s": (80, lambda: 142 * 1.7 / 3),
}


def units(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph (lines between blank ones; each table row alone)."""
    out, start, lines = [], 1, []
    for no, line in enumerate(text.splitlines() + [""], 1):
        if line.lstrip().startswith("|"):
            if lines:
                out.append((start, " ".join(lines)))
            out.append((no, line))
            lines = []
        elif line.strip():
            if not lines:
                start = no
            lines.append(line.strip())
        elif lines:
            out.append((start, " ".join(lines)))
            lines = []
    return out


def figures(text: str) -> list[tuple[int, str, str]]:
    """(line, the figure, its paragraph) of every duration or rate in text."""
    return [(no, m.group(0).strip(), unit) for no, unit in units(text)
            for m in sorted((m for rx in (DURATION, RATE) for m in rx.finditer(unit)), key=lambda m: m.start())]


def sourced(unit: str) -> bool:
    """A paragraph naming where its figures were measured: an existing notes/ file, or a command and a machine."""
    if any((REPO / "notes" / name).is_file() for name in NOTE.findall(unit)):
        return True
    return bool(COMMAND.search(unit) and MACHINE.search(unit))


def derived(fig: str, unit: str) -> bool:
    """Whether a figure is one of DERIVED's phrases, as its paragraph writes it."""
    flat = " ".join(unit.split())
    return any(fig in phrase and phrase in flat for phrase in DERIVED)


def unsourced(text: str) -> list[tuple[int, str]]:
    return [(no, fig) for no, fig, unit in figures(text) if not sourced(unit) and not derived(fig, unit)]


def test_the_scanner_finds_durations_and_rates():
    text = ("Fast. About 6\nminutes on a laptop.\n\nIt reads 2.9-4.2 GB/s and\n1,300 tokens/s; a 0.174 s/step run "
            "and 70 ms.\n\n| a | 12 s |\n\nnot figures: 2s.md, scripts/x.py, 3 sizes, 8x4: 2.12, v1.5\n")
    assert [(no, fig) for no, fig, _ in figures(text)] == [
        (1, "6\nminutes".replace("\n", " ")), (4, "2.9-4.2 GB/s"), (4, "1,300 tokens/s"), (4, "0.174 s/step"),
        (4, "70 ms"), (7, "12 s")]


def test_a_figure_needs_a_note_a_command_and_machine_or_a_derivation():
    assert unsourced("It took about 6 minutes.\n") == [(1, "6 minutes")]
    assert unsourced("It took 6 minutes on a 2-core CPU.\n") == [(1, "6 minutes")]  # which command?
    assert unsourced("`python scripts/finetune.py` took 6 minutes.\n") == [(1, "6 minutes")]  # on what?
    assert unsourced("`python scripts/finetune.py` took 6 minutes on a 2-core CPU.\n") == []
    assert unsourced("It took 6 minutes (notes/quick-profile.md).\n") == []
    assert unsourced("It took 6 minutes (notes/no-such-note.md).\n") == [(1, "6 minutes")]
    assert unsourced("k is chosen so the compute measurement takes about 12 s.\n") == []


def test_every_figure_in_the_docs_is_derived_or_sourced():
    missing = [f"{page.relative_to(REPO)}:{no}: {fig}" for page in PAGES for no, fig in unsourced(page.read_text())]
    assert not missing, f"figures with no source (name the notes/ file, or the command and machine, or derive " \
                        f"them in DERIVED): {missing}"


@pytest.mark.parametrize("phrase", sorted(DERIVED))
def test_each_derived_figure_is_on_a_page_and_equals_its_derivation(phrase):
    stated, derive = DERIVED[phrase]
    assert any(phrase in " ".join(page.read_text().split()) for page in PAGES), f"no page says {phrase!r}"
    assert abs(derive() - stated) <= 0.05 * stated, (phrase, derive())
