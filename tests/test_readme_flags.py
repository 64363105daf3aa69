"""Every flag README.md documents for `scripts/finetune.py` exists, and some CLI test passes it.

Documented for finetune.py: the flags of the "## Finetuning" section (lines running another
script excepted), of every README line that runs finetune.py (with its `\\` continuations), and any
other README flag that finetune.py accepts (e.g. `--ram-budget` in the budgets section). A test
"passes" a flag when a test module that drives finetune.py has it as a string literal
(`"--flag"`, `"--flag=..."`; `--no-flag` counts for a boolean `--flag`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
IGNORED = {"--help"}  # argparse's own
# Documented flags no CLI test passes yet (all are passed now, by test_finetune_flags.py). Never
# grow it: a flag added to README comes with a test that passes it.
KNOWN_MISSING: set[str] = set()


def parser_flags() -> set[str]:
    """The long options finetune.py's parser accepts (from its --help, in process)."""
    spec = importlib.util.spec_from_file_location("finetune_flags", REPO / "scripts" / "finetune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    return set(FLAG.findall(out.getvalue()))


def readme_finetune_flags() -> tuple[set[str], set[str]]:
    """(flags README gives finetune.py explicitly, every flag in README)."""
    lines = README.read_text().splitlines()
    explicit, in_section, continued = set(), False, False
    for line in lines:
        if line.startswith("## "):
            in_section = line.strip() == "## Finetuning"
        runs_finetune = "finetune.py" in line or continued
        other_script = "scripts/" in line and "finetune.py" not in line
        if runs_finetune or (in_section and not other_script):
            explicit |= set(FLAG.findall(line.partition("finetune.py")[2] or line))  # not torchrun's own
        continued = runs_finetune and line.rstrip().endswith("\\")
    return explicit, set(FLAG.findall("\n".join(lines)))


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
    explicit, _ = readme_finetune_flags()
    accepted = parser_flags()
    assert len(explicit) > 20, f"README's finetune flags were not found: {sorted(explicit)}"
    unknown = sorted(explicit - accepted - IGNORED)
    assert not unknown, f"README documents finetune.py flags the script does not accept: {unknown}"


def test_every_readme_finetune_flag_is_passed_by_a_cli_test():
    explicit, everywhere = readme_finetune_flags()
    documented = (explicit | (everywhere & parser_flags())) - IGNORED
    missing = documented - flags_in_tests()
    new = sorted(missing - KNOWN_MISSING)
    assert not new, (f"README documents these finetune.py flags but no CLI test passes them: {new} "
                     f"(add a test that runs finetune.py with each)")
    if covered := sorted(KNOWN_MISSING - missing):
        warnings.warn(f"now tested, drop from KNOWN_MISSING in {Path(__file__).name}: {covered}")
