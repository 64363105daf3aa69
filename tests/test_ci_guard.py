"""Under CI=true the cross-check modules cannot skip for a missing library: the run fails instead.

The cross-checks (tests/test_reference*.py, tests/test_export_hf.py) compare phantom with code it did not
write, and get the libraries through their `need(module)`: a skip outside CI, an ImportError under CI=true.
Here they are collected in a fresh process where those libraries cannot be imported: without CI they
skip (so the block really removed them), with CI=true they must error. A static check finds what
collection would not reach: importorskip or a skip anywhere else in those files.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CROSS_CHECKS = sorted((ROOT / "tests").glob("test_reference*.py")) + [ROOT / "tests" / "test_export_hf.py"]
# Skips that are not about a missing library, each with why it may stay a skip in CI.
ALLOWED_SKIPS = {
    ("test_reference_train.py", "test_compile_builds_a_graph_and_does_not_fall_back"):
        "torch.compile needs a C compiler on the machine, not a Python library",
}


def needed(path: Path) -> set[str]:
    """The modules a file asks for through need("...")."""
    tree = ast.parse(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "need"
            and node.args and isinstance(node.args[0], ast.Constant)}


def collect(env_ci: str | None, blocked: set[str], tmp_path: Path) -> subprocess.CompletedProcess:
    block = tmp_path / "blocked"
    block.mkdir(exist_ok=True)
    for name in blocked:  # found before site-packages: `import name` raises as if it were not installed
        message = f"No module named {name!r} (blocked by {Path(__file__).name})"
        (block / f"{name}.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(block), *filter(None, [env.get("PYTHONPATH")])])
    if env_ci is not None:
        env["CI"] = env_ci
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rsE", "-p", "no:cacheprovider",
                           *map(str, CROSS_CHECKS)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ci_runs_with_ci_true():
    assert re.search(r"^export CI=true\b", (ROOT / ".ci" / "run").read_text(), re.M)


def test_cross_checks_error_instead_of_skipping_under_ci(tmp_path):
    assert {p.name for p in CROSS_CHECKS} >= {"test_reference.py", "test_reference_tokenizer.py",
                                              "test_reference_train.py", "test_export_hf.py"}
    libs = set().union(*map(needed, CROSS_CHECKS))
    assert {"transformers", "peft", "tokenizers", "tiktoken"} <= libs, libs
    guarded = {p.name for p in CROSS_CHECKS if needed(p)}
    local = collect(None, libs, tmp_path)
    out = local.stdout + local.stderr
    assert set(re.findall(r"^SKIPPED \[\d+\] tests/(test_\w+\.py):", out, re.M)) == guarded, out[-3000:]
    assert not re.search(r"^ERROR ", out, re.M), out[-3000:]
    ci = collect("true", libs, tmp_path)
    out = ci.stdout + ci.stderr
    assert ci.returncode != 0 and not re.search(r"^SKIPPED ", out, re.M), out[-3000:]
    assert set(re.findall(r"^ERROR tests/(test_\w+\.py)", out, re.M)) == guarded, out[-3000:]
    assert "blocked by" in out, out[-3000:]


@pytest.mark.parametrize("path", CROSS_CHECKS, ids=lambda p: p.name)
def test_cross_checks_skip_only_through_need(path):
    """No importorskip, skip or skipif in a cross-check file but in need() (and ALLOWED_SKIPS)."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Attribute) and node.attr in ("importorskip", "skip", "skipif") \
                and where != "need" and (path.name, where) not in ALLOWED_SKIPS:
            found.append(f"{where}: line {node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    assert not found, f"{path.name} skips outside need(): {found}"


def test_ci_runs_the_readme_test_command_in_a_new_venv():
    """.ci/run takes the one indented test command from README.md and runs it inside a fresh venv."""
    run = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in run and 'source "$venv/bin/activate"' in run
    extract = re.search(r"^command=\$\((.*)\)$", run, re.M).group(1)
    commands = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    assert len(commands) == 1 and "torch==2.13.0" in commands[0] and "pytest" in commands[0], commands
