"""The README and every docs/ page match the scripts and the code: flags, commands, defaults, links.

Flags: every `--flag` the docs name is a flag of some script; every command line they show
(`python scripts/X.py ...`, with its `\\` continuations) passes only flags X takes; on the pages about
finetune.py (`FINETUNE_PAGES`) a flag outside another script's line is finetune.py's; and every
finetune.py flag the docs name is passed by a CLI test (a test module that drives finetune.py has it
as a string literal: `"--flag"`, `"--flag=..."`; `--no-flag` counts for a boolean `--flag`).

Defaults are written one way, right after the backticked flag or argument they belong to:
`` `--prefetch K|auto` (default `2`) `` for a fixed value (checked equal to the code's: a flag of
finetune.py, else of the one script that has it; `phantom.load`'s arguments in docs/api.md against its
signature and the Placement and Activations fields), or `` `--lr` (default: by the model's size) `` in
words for what the code decides at run time (checked: the code has no fixed value). The budget
formulas stated in words are computed and compared with the code's.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import io
import re
import warnings
from pathlib import Path
from unittest import mock

import argparse
import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FINETUNE_PAGES = {"training.md", "data.md", "preference.md"}  # prose flags there are finetune.py's
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"(?:(?:scripts|benchmarks)/)?\b(\w+)\.py\b")
IGNORED = {"--help", "--nproc-per-node", "--lora"}  # argparse's own; torchrun's; llama.cpp's llama-cli
# Documented flags no CLI test passes yet (all are passed now, by test_finetune_flags.py). Never
# grow it: a flag added to the docs comes with a test that passes it.
KNOWN_MISSING: set[str] = set()
DEFAULT = re.compile(r"`([^`]+)` \(default(?: `([^`]*)`|: ([^)]*))")  # (name, value) or (name, words)


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def lines_of(page: Path) -> list[str]:
    return page.read_text().splitlines()


class _Parsed(BaseException):
    """Raised by the patched parse_args: the script built its parser, nothing else runs."""


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each script's argument parser, as its main or parse_args builds it (nothing else runs)."""
    out = {}
    for path in sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]):
        spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        built = []

        def capture(self, *args, **kwargs):
            built.append(self)
            raise _Parsed

        entry = getattr(mod, "parse_args", None) or mod.main
        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
                mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
                contextlib.suppress(_Parsed):
            entry(*([[]] if inspect.signature(entry).parameters else []))
        assert built, f"{path.name}: no argument parser found"
        out[path.stem] = built[0]
    return out


def flags_of(script: str) -> dict[str, argparse.Action]:
    return {opt: a for a in parsers()[script]._actions for opt in a.option_strings if opt.startswith("--")}


def commands(page: Path) -> list[tuple[str, str, str]]:
    """(script, its arguments, the comment) of each command line the page shows, continuations joined."""
    out, pending = [], None
    for line in lines_of(page) + [""]:
        if pending is not None:
            pending += " " + line.strip()
        elif (m := SCRIPT.search(line)) and m.group(1) in parsers() and re.search(r"python3?\s|torchrun", line):
            pending = line
        if pending is not None and not pending.rstrip().endswith("\\"):
            code, _, comment = pending.partition("  #")
            script = next(m.group(1) for m in SCRIPT.finditer(code) if m.group(1) in parsers())
            out.append((script, code.split(f"{script}.py", 1)[1].replace("\\", " "), comment))
            pending = None
    return out


def finetune_flags() -> tuple[set[str], set[str]]:
    """(flags the docs give finetune.py explicitly, every flag the docs name)."""
    explicit, everywhere = set(), set()
    for page in PAGES:
        everywhere |= set(FLAG.findall(page.read_text()))
        explicit |= {f for script, args, _ in commands(page) if script == "finetune" for f in FLAG.findall(args)}
        if page.name in FINETUNE_PAGES:
            for line in lines_of(page):
                names = {m.group(1) for m in SCRIPT.finditer(line)} & set(parsers())
                if not names - {"finetune"}:  # a line about another script is checked by the tests below
                    explicit |= set(FLAG.findall(line.partition("finetune.py")[2] or line))
    return explicit, everywhere


def flags_in_tests() -> set[str]:
    """Flags passed as string literals in the test modules that drive finetune.py."""
    found = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        src = path.read_text()
        if not re.search(r"finetune(\.py)?[\"']", src):  # script("finetune"), load_script("finetune"), ".../finetune.py"
            continue
        for flag in re.findall(r"[\"'](--[a-z][a-z0-9-]*)(?=[\"'=])", src):
            found.add(flag)
            if flag.startswith("--no-"):
                found.add("--" + flag[len("--no-"):])
    return found


def test_readme_finetune_flags_exist():
    explicit, _ = finetune_flags()
    accepted = set(flags_of("finetune"))
    assert len(explicit) > 40, f"the docs' finetune flags were not found: {sorted(explicit)}"
    unknown = sorted(explicit - accepted - IGNORED)
    assert not unknown, f"the docs give finetune.py flags the script does not accept: {unknown}"


def test_every_readme_finetune_flag_is_passed_by_a_cli_test():
    explicit, everywhere = finetune_flags()
    documented = (explicit | (everywhere & set(flags_of("finetune")))) - IGNORED
    missing = documented - flags_in_tests()
    new = sorted(missing - KNOWN_MISSING)
    assert not new, (f"the docs name these finetune.py flags but no CLI test passes them: {new} "
                     f"(add a test that runs finetune.py with each)")
    if covered := sorted(KNOWN_MISSING - missing):
        warnings.warn(f"now tested, drop from KNOWN_MISSING in {Path(__file__).name}: {covered}")


def test_every_documented_command_passes_flags_its_script_takes():
    shown, wrong = 0, []
    for page in PAGES:
        for script, args, _ in commands(page):
            shown += 1
            wrong += [(rel(page), script, f) for f in FLAG.findall(args) if f not in flags_of(script)]
    assert shown > 40 and not wrong, (shown, wrong)
    assert {s for p in PAGES for s, _, _ in commands(p)} >= {"prepare_model", "finetune", "generate",
                                                             "merge_lora", "tune", "bench"}


def test_every_documented_flag_is_a_flag_of_some_script():
    known = {f for script in parsers() for f in flags_of(script)} | IGNORED
    unknown = {(rel(page), f) for page in PAGES for f in FLAG.findall(page.read_text()) if f not in known}
    assert not unknown, f"the docs name flags no script takes: {sorted(unknown)}"


def stated_defaults() -> list[tuple[str, str, str | None, str | None]]:
    """(page, name, value, words) of every default the docs state."""
    return [(rel(page), m.group(1), m.group(2), m.group(3)) for page in PAGES
            for m in DEFAULT.finditer(page.read_text().replace("\n", " "))]


def test_every_stated_default_follows_the_convention():
    """A default is stated right after what it belongs to, so that the tests below find and check it."""
    for page in PAGES:
        text = page.read_text().replace("\n", " ")
        found = len(re.findall(r"\(default[ :]", text))
        assert found == len(DEFAULT.findall(text)), (
            f"{rel(page)}: write a default as `--flag ARG` (default `VALUE`) or `name` (default: words), "
            f"right after the backticked flag or argument: {re.findall(r'.{40}[(]default[ :].{20}', text)}")
    assert len(stated_defaults()) > 30


def code_default(flag: str) -> tuple[str, object]:
    """(script, default) of a flag: finetune.py's, else the one script's that has it; None: decided at run time
    (a flag generated from a config field, or resolved later, shows its fixed default in its help)."""
    owners = [s for s in ("finetune", *sorted(parsers())) if flag in flags_of(s)]
    assert owners, f"no script takes {flag}"
    assert owners[0] == "finetune" or len(set(owners)) == 1, f"{flag}: say which script ({owners})"
    action = flags_of(owners[0])[flag]
    if action.default is not None and action.default is not argparse.SUPPRESS:
        return owners[0], action.default
    shown = re.search(r"\(default: (?:its )?([^\s;),]+)[;)]", action.help or "")  # "(default: 2)", "(default: its 50GB; ...)"
    return owners[0], shown.group(1) if shown and shown.group(1) != "None" else None


def test_every_documented_flag_default_equals_the_code_s():
    checked, wrong = 0, []
    for page, name, value, words in stated_defaults():
        if not name.startswith("--"):
            continue
        flag = FLAG.match(name).group(0)
        script, code = code_default(flag)
        checked += 1
        if value is not None and str(code) != value:
            wrong.append(f"{page}: {flag} (default `{value}`), {script}.py's default is {code!r}")
        if words is not None and code not in (None, False):
            wrong.append(f"{page}: {flag} (default: {words}), {script}.py's default is fixed: `{code}`")
    assert checked > 30 and not wrong, "\n".join(wrong)


def test_the_budget_formulas_documented_are_the_code_s():
    from phantom.stream import placement

    GiB = 1 << 30
    funcs = {"--device-budget": placement.device_budget, "--ram-budget": placement.ram_budget}
    stated = {name.split()[0]: words for _, name, _, words in stated_defaults() if name.split()[0] in funcs}
    assert stated.keys() == funcs.keys(), stated
    for flag, words in stated.items():
        share, less = re.fullmatch(r"(\d+)% of .* less (\d+) GiB", words).groups()
        for free in (8 * GiB, 64 * GiB, 1000 * GiB):
            assert funcs[flag](free) == max(0, int(free * int(share) / 100) - int(less) * GiB), (flag, words)


def test_phantom_load_defaults_documented_are_the_code_s():
    import dataclasses

    import phantom

    code = {n: p.default for n, p in inspect.signature(phantom.load).parameters.items()
            if p.default is not inspect.Parameter.empty}
    for cls in (phantom.Placement, phantom.Activations):
        code.update({f.name: f.default for f in dataclasses.fields(cls)})
    stated = [(n, v, w) for page, n, v, w in stated_defaults() if page == "docs/api.md"]
    assert len(stated) >= 10, stated
    for name, value, words in stated:
        assert name in code, f"docs/api.md states a default of {name}, which phantom.load does not take"
        if value is not None:
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(value)
            assert value == code[name] or value == str(code[name]), (name, value, code[name])
        else:
            assert code[name] is None, f"docs/api.md: {name} (default: {words}), but the code's is {code[name]!r}"


def test_prefetch_defaults_to_a_fixed_2_everywhere():
    """The docs say why 2 and not `auto`; the parser, RunConfig, Placement and phantom.load agree."""
    from phantom import Placement, RunConfig

    stated = {(page, v) for page, name, v, _ in stated_defaults() if re.match(r"(--)?prefetch\b", name)}
    assert {v for _, v in stated} == {"2"} and len(stated) >= 3, stated
    assert Placement().prefetch == 2 and RunConfig().placement.prefetch == 2 and RunConfig().prefetch is None
    assert "needs no measurement" in (REPO / "docs" / "placement.md").read_text()


def anchors(page: Path) -> set[str]:
    """The #anchors of a page's headings, as GitHub writes them."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


WRITTEN_BY_RUNS = {"notes/bench-cuda.md"}  # where bench.py appends its table on a GPU; none is recorded yet


def test_links_and_repository_paths_in_the_docs_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", text):
            if target.startswith("http"):
                continue
            if not (page.parent / target).exists():
                missing.append((rel(page), target))
            elif anchor and anchor not in anchors(page.parent / target):
                missing.append((rel(page), f"{target}#{anchor}"))
        for path in re.findall(r"(?<![\w/.-])((?:phantom|scripts|benchmarks|tests|notes|examples|docs)/[\w./-]*\.(?:py|md|yaml|txt|jsonl))",
                               text):
            if not (REPO / path).exists() and path not in WRITTEN_BY_RUNS:
                missing.append((rel(page), path))
    assert not missing, f"the docs point at files that are not there: {missing}"


def test_the_python_imports_the_docs_show_resolve():
    shown = [line.strip() for page in PAGES for line in lines_of(page)
             if re.match(r"\s*(from phantom[\w.]* import [\w, ]+|import phantom\b[\w., ]*)$", line)]
    assert len(shown) >= 4, shown
    for line in shown:
        exec(line, {})  # noqa: S102 - an import line the docs show
