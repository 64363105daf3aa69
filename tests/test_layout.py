"""Package and module boundaries as rules the suite checks, not prose that drifts.

Data flows one way: checkpoint files -> converter -> block store -> scheduler -> model (executor) ->
trainer -> adapter/checkpoint files. phantom/ holds one subpackage per stage of that flow, ranked:
a module may import modules of lower-ranked packages, and modules of its own package of lower rank
(so no cycles, and the pure parts never reach for I/O or threads). The layout table in the docs must
list every module with exactly the phantom modules it imports.
"""
from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {  # the flow, in import order: each package imports only those above it
    "base": 0,     # JSON within bounds, fault points, dtypes, checksums, atomic file replaces: no domain
    "data": 1,     # tokenizers, chat templates, data files, token caches, rows
    "arch": 2,     # what a model is: config, families, layers, mixture of experts, quantization formats
    "files": 3,    # safetensors files, direct I/O, the block store, sealed folders
    "convert": 4,  # checkpoints in: Meta's and Hugging Face's files read into stores, synthetic stores, the Hub cache
    "stream": 5,   # placement, memory, host buffers, tiers, transfer, write-back, scheduler, executor
    "model": 6,    # LoRA, adapter files, the phantom model over its blocks, generation
    "export": 7,   # checkpoints out: merged Hugging Face checkpoints, GGUF files
    "plan": 8,     # the cost model and the tuner
    "train": 9,    # the loop, checkpoints, preference pairs, trackers, run files, RunConfig and run()
}
RANK = {  # within a package
    "base": {"safejson": 0, "cpufeatures": 0, "faults": 1, "dtypes": 1, "provenance": 1, "checksum": 1, "fileio": 2},
    "data": {"special_tokens": 0, "tokenfiles": 0, "tokenizer": 1, "sources": 1, "chat": 2, "tokencache": 2,
             "recordformats": 3, "dataset": 4, "batches": 5, "showdata": 6},
    "arch": {"config": 0, "quantformat": 1, "moe": 1, "presets": 1, "ops": 1, "mla": 3, "familybase": 2,
             "family_moe": 3, "family_gemma": 3, "family_phi": 3, "family_deepseek": 4, "family_gptoss": 4,
             "deltanet": 2, "family_qwen35": 4, "family_llama4": 4, "quant": 2, "layers": 4,
             "family": 6, "expertlora": 5, "tiled": 0, "dsa": 2, "carry": 1, "family_dsa": 5,
             "compressed": 2, "hyper": 3, "family_deepseek_v4": 5},
    "files": {"tensorfile": 0, "directio": 1, "hfshards": 1, "fusedrows": 1, "runfolder": 1, "seal": 1,
              "storeformat": 1, "storelinks": 2, "workingcopy": 2, "storeverify": 3, "storewriter": 3, "store": 4},
    "stream": {"hostmem": 0, "trace": 0, "experts": 0, "cpukernel": 0, "adam8bit": 1, "moeblock": 0, "tiers": 1, "writeback": 1, "placement": 2, "optim": 2, "memory": 3,
               "transfer": 3, "residency": 4, "scheduler": 5, "executor": 6, "lanes": 0,
               "kvcache": 1, "hostinputs": 1},
    "convert": {"checkpoints": 0, "visionlanguage": 0, "hflayout": 1, "convert": 1, "synthetic": 2, "quantstore": 2, "hub": 2, "requant": 2},
    "model": {"lora": 0, "adapterfiles": 1, "heads": 0, "backends": 1, "fullmode": 1, "phantom_model": 2, "generate": 3,
              "adaptermodel": 2},
    "export": {"gguf_pretok": 0, "gguf_vocab": 1, "gguf_hparams": 0, "gguf_arch": 1, "gguf_export": 2, "gguf_deepseek4": 3, "gguf_lora": 3,
               "export": 4},
    "plan": {"costinputs": 0, "costmodel": 1, "quickslice": 1, "costexperts": 2, "planner": 2, "computetimer": 3,
             "profiles": 4, "tune": 5, "costsweep": 2, "costgen": 2, "gentimer": 4, "costgrpo": 3, "costscore": 1,
             "costfull": 2, "optimtimer": 3, "gpusheets": 1},
    "train": {"trackers": 0, "dist": 0, "load": 0, "runcard": 0, "runfile": 0, "records": 0, "checkpoint": 1,
              "score": 0, "lmeval": 3, "evaltasks": 4,
              "preference": 1, "grpo": 2, "trainconfig": 3, "cli": 2, "step": 4, "runconfig": 4, "grpoloop": 5,
              "loop": 6, "runner": 7, "sweep": 7, "sweeprun": 8, "launch": 9},
}
TOP = "__init__"  # phantom/__init__.py: the public API, above everything


def phantom_imports(source: str) -> set[str]:
    """The phantom modules ("package.module") a module's source imports (anywhere in it, functions
    included); a name imported from phantom itself is the top ("__init__")."""
    deps = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "phantom":
            parts = node.module.split(".")
            if len(parts) == 1:
                deps.add(TOP)
            elif len(parts) == 2:
                deps |= {f"{parts[1]}.{a.name}" for a in node.names}
            else:
                deps.add(f"{parts[1]}.{parts[2]}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "phantom":
                    deps.add(f"{parts[1]}.{parts[2]}" if len(parts) > 2 else f"{parts[1]}.__init__" if len(parts) == 2 else TOP)
    return deps


def rank(module: str) -> tuple[int, int] | None:
    """(package rank, rank within it); None where the tables do not list it."""
    if module == TOP:
        return (len(PACKAGES), 0)
    pkg, _, name = module.partition(".")
    if pkg not in PACKAGES or name not in RANK[pkg]:
        return None
    return (PACKAGES[pkg], RANK[pkg][name])


def violations(module: str, source: str) -> list[str]:
    mine = rank(module)
    if mine is None:
        return [f"phantom/{module.replace('.', '/')}.py has no rank in tests/test_layout.py: give it one"]
    bad = []
    for dep in sorted(phantom_imports(source) - {module}):
        theirs = rank(dep)
        same_package = theirs is not None and theirs[0] == mine[0]
        if theirs is None or theirs[0] > mine[0] or (same_package and theirs[1] >= mine[1]):
            bad.append(f"phantom/{module.replace('.', '/')}.py (rank {mine}) imports {dep} (rank {theirs})")
    return bad


def modules() -> dict[str, str]:
    """Every module of phantom/ by "package.module" (the public API by "__init__")."""
    found = {TOP: (ROOT / "phantom" / "__init__.py").read_text()}
    for p in sorted((ROOT / "phantom").glob("*/*.py")):
        if p.name != "__init__.py":
            found[f"{p.parent.name}.{p.stem}"] = p.read_text()
    return found


def test_modules_import_only_lower_ranks():
    bad = [v for name, src in modules().items() for v in violations(name, src)]
    assert not bad, "\n".join(bad)


def test_every_module_lives_in_a_package():
    """phantom/ holds the packages and the public API alone; a package's __init__ says what it holds
    and imports nothing (importing a package never starts work)."""
    loose = sorted(p.name for p in (ROOT / "phantom").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"put these in a package of phantom/: {loose}"
    assert sorted(p.name for p in (ROOT / "phantom").iterdir() if p.is_dir() and (p / "__init__.py").exists()) \
        == sorted(PACKAGES)
    for pkg in PACKAGES:
        init = (ROOT / "phantom" / pkg / "__init__.py").read_text()
        tree = ast.parse(init)
        assert ast.get_docstring(tree), f"phantom/{pkg}/__init__.py: say what the package holds"
        assert not phantom_imports(init) and not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body), pkg


def test_module_names_are_unique():
    """A module's name says what it is without its package: no two share one."""
    names = [m.split(".")[1] for m in modules() if m != TOP]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_rule_catches_a_forbidden_import():
    """Shown once, kept: the store reaching up into the model is flagged, as is a relative-style alias."""
    src = modules()["files.store"]
    assert violations("files.store", src) == []
    assert violations("files.store", src + "\nfrom phantom.model.phantom_model import PhantomModel\n")
    assert violations("files.store", src + "\ndef f():\n    import phantom.stream.scheduler\n")
    assert violations("arch.layers", "from phantom.files import store\n")
    assert violations("files.tensorfile", "from phantom.files import store\n")  # within a package too
    assert violations("base.fileio", "from phantom import load\n")


def test_phantom_never_imports_scripts_or_tests():
    for name, src in modules().items():
        for node in ast.walk(ast.parse(src)):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(m.split(".")[0] in ("scripts", "benchmarks", "benchlib", "tests", "conftest") for m in mods), name


def test_readme_layout_table_matches_the_code():
    section = (ROOT / "docs" / "layout.md").read_text()
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `phantom/(\w+)/(\w+)\.py` \|[^|]*\| ([^|]*) \|", line)
        if m:
            rows[f"{m.group(1)}.{m.group(2)}"] = {d.strip() for d in m.group(3).split(",") if d.strip() not in ("", "—")}
    code = {name: phantom_imports(src) - {name} for name, src in modules().items() if name != "__init__"}
    assert rows.keys() == code.keys(), f"docs/layout.md lists {sorted(rows)}; phantom has {sorted(code)}"
    wrong = {name: (sorted(rows[name]), sorted(code[name])) for name in code if rows[name] != code[name]}
    assert not wrong, f"docs/layout.md's imports column differs from the code (docs, code): {wrong}"


@pytest.mark.parametrize("name", sorted(f"{pkg}.{m}" for pkg, mods in RANK.items() for m in mods))
def test_every_ranked_module_exists(name):
    assert (ROOT / "phantom" / f"{name.replace('.', '/')}.py").is_file(), f"RANK lists {name}, which is gone: remove it"


def test_a_knob_added_to_placement_reaches_the_cli_the_api_the_tuner_and_the_checkpoint(tmp_path):
    """Add one field to Placement's source and edit nothing else: finetune.py gets the flag, the tuner
    (--prefetch auto) keeps it, the model and its scheduler get it, the checkpoint records it, and
    phantom.load takes it by name. Runs a copy of phantom/ and scripts/ with the field added."""
    import json
    import shutil
    import subprocess
    import sys
    copy = tmp_path / "repo"
    for part in ("phantom", "scripts"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "phantom" / "stream" / "placement.py"
    anchor = "    shared_ram: bool = knob("
    assert anchor in source.read_text()
    source.write_text(source.read_text().replace(
        anchor, '    probe_depth: int = knob(3, "a knob this test adds")\n' + anchor, 1))

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(copy / "scripts" / "finetune.py"), "--model", "tiny", "--iters", "2",
                          "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--val-split", "0", "-q",
                          "--prefetch", "auto", "--probe-depth", "5", "--out", str(out)],
                         cwd=copy, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert meta["placement"]["probe_depth"] == 5, meta["placement"]

    api = subprocess.run([sys.executable, "-c", "import phantom\n"
                          "with phantom.load('tiny', offload='disk', probe_depth=7) as m:\n"
                          "    print(phantom.__file__, m.placement.probe_depth, m.scheduler.placement.probe_depth)"],
                         cwd=copy, capture_output=True, text=True, timeout=600)
    assert api.returncode == 0, api.stderr[-3000:]
    where, *depths = api.stdout.split()
    assert Path(where).is_relative_to(copy) and depths == ["7", "7"], api.stdout


# -- rules of structure ------------------------------------------------------------------------

def calls_to(src: str, names: set[str]) -> set[str]:
    """The names of `names` a module's source refers to (a call, an import, an attribute)."""
    found = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found |= {a.name for a in node.names if a.name in names}
    return found


def decides_streaming(src: str) -> bool:
    """A test of the form `t == "disk" or (t == "ram" and ...)`: deciding which blocks stream."""
    def compares_to(node, word):
        return any(isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == word
                                                      for c in [n.left, *n.comparators]) for n in ast.walk(node))
    return any(isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
               and compares_to(node, "disk") and compares_to(node, "ram") for node in ast.walk(ast.parse(src)))


def test_only_placement_decides_where_blocks_live_and_which_stream():
    """Tiers, streamed blocks and loads per step come from placement.resolve; no other module computes
    them (the scheduler, the cost model, the tuner and bench read its Layout)."""
    sources = sources_with_scripts()
    bad = {name: sorted(used) for name, src in sources.items() if name != "stream.placement"
           if (used := calls_to(src, {"assign_tiers", "loads_per_step", "_layout"}))}
    assert not bad, f"only phantom.stream.placement may call these (use placement.resolve / Layout): {bad}"
    deciding = [name for name, src in sources.items() if name != "stream.placement" and decides_streaming(src)]
    assert not deciding, f"which blocks stream is Layout.streamed; computed again in {deciding}"
    assert decides_streaming(modules()["stream.placement"])  # the check sees the rule where it is


def adds_one_to_prefetch(src: str) -> list[int]:
    """Lines of `<...>prefetch + 1` (or `1 + <...>prefetch`): the device slots computed from the knob."""
    def is_prefetch(n):
        return (isinstance(n, ast.Attribute) and n.attr == "prefetch") or (isinstance(n, ast.Name) and n.id == "prefetch")
    return [node.lineno for node in ast.walk(ast.parse(src)) if isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add) and {type(node.left), type(node.right)} & {ast.Constant}
            and (is_prefetch(node.left) or is_prefetch(node.right))]


def test_slots_are_derived_once():
    """The device slots of a streaming run are `Placement.slots` (and `Layout.slots`); nothing else
    adds one to the prefetch depth."""
    sources = sources_with_scripts()
    found = {name: lines for name, src in sources.items() if (lines := adds_one_to_prefetch(src))}
    assert list(found) == ["stream.placement"] and len(found["stream.placement"]) == 1, \
        f"use Placement.slots / Layout.slots instead of prefetch + 1: {found}"


DTYPE_WORDS = {"fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "F32", "BF16", "F16"}


def dtype_tables(src: str) -> list[int]:
    """Lines of dict literals keyed or valued by two or more dtype names: a table of dtypes."""
    def words(nodes):
        return {n.value for n in nodes if isinstance(n, ast.Constant) and n.value in DTYPE_WORDS}
    return [node.lineno for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Dict)
            and len(words(node.keys) | words(node.values)) >= 2]


def test_one_dtype_table():
    """Names, sizes and file codes of dtypes live in phantom.base.dtypes alone."""
    found = {name: lines for name, src in modules().items() if name != "base.dtypes" and (lines := dtype_tables(src))}
    assert not found, f"read phantom.base.dtypes instead of another table of dtypes: {found}"
    assert dtype_tables("{'fp32': 4, 'bf16': 2}")  # the check sees a table where there is one


def test_every_replace_goes_through_fileio():
    """Temporary names, renames, folder swaps and the files created to be written in place (os.open with O_CREAT,
    os.fdopen) live in phantom.base.fileio alone: one rule for every file and folder phantom writes."""
    bad = {}
    for name, src in modules().items():
        if name == "base.fileio":
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                creates = owner == "os" and f.attr == "open" and "O_CREAT" in ast.unparse(node)
                if (owner == "os" and f.attr in ("replace", "rename", "fdopen")) or f.attr == "rename" or creates or \
                        (owner == "tempfile" and f.attr in ("mkdtemp", "mkstemp")):
                    bad.setdefault(name, []).append(f"{owner or '...'}.{f.attr} (line {node.lineno})")
    assert not bad, f"use phantom.base.fileio (atomic_write, replacing, replacing_folder, swap_folder, new_file): {bad}"


MAX_LINES, MAX_PARAMS = 60, 8
EXCEPTIONS = {
    # name: why it may be longer or take more parameters than the rule allows (at most three)
    "train.load.load": "the public entry point: the store, where it computes, and one argument per config "
                     "(placement, activations, lora, mode, optim), each also reachable as a keyword",
    "model.heads.ChunkedHead*.forward": "the fused head's autograd Functions (loss, sequence log-probabilities): their "
                                  "inputs are the maths' (hidden states, norm and head weights, targets, eps, "
                                  "chunk, the family's norm offset and soft cap)",
    "convert.synthetic.write_synthetic": "the synthetic store's every choice (weights, tokenizer, its extra files, "
                               "quantization) as keywords with defaults; tests and benchmarks set each",
}


TOOLS = ("scripts", "benchmarks")  # the commands a user runs; the benchmarks and their library


def sources_with_scripts() -> dict[str, str]:
    """Every module of phantom/ (by "package.module"), of scripts/ and of benchmarks/ (by "<folder>/<path>")."""
    tools = {f"{folder}/{p.relative_to(ROOT / folder).with_suffix('')}": p.read_text()
             for folder in TOOLS for p in sorted((ROOT / folder).rglob("*.py"))}
    return {**modules(), **tools}


def functions():
    """(module.Class.function, node, parameter names) of every function in phantom/ and scripts/."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                yield f"{prefix}.{child.name}", child, params
                yield from walk(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}.{child.name}")
    for name, src in sources_with_scripts().items():
        yield from walk(ast.parse(src), name)


MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 250


def test_modules_and_classes_are_small():
    """A module holds one concern (at most 500 lines), a class one role (at most 250)."""
    big = [f"{name} ({n} lines)" for name, src in sources_with_scripts().items()
           if (n := len(src.splitlines())) > MAX_MODULE_LINES]
    wide = [f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, src in sources_with_scripts().items() for node in ast.walk(ast.parse(src))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
    assert not wide, f"classes over {MAX_CLASS_LINES} lines: {wide}"


def excepted(qualname: str) -> bool:
    return any(fnmatch.fnmatch(qualname, pattern) for pattern in EXCEPTIONS)


def test_functions_are_short_and_take_few_parameters():
    assert len(EXCEPTIONS) <= 3
    long = [f"{q} ({n.end_lineno - n.lineno + 1} lines)" for q, n, _ in functions()
            if n.end_lineno - n.lineno + 1 > MAX_LINES and not excepted(q)]
    wide = [f"{q} ({len(p)} parameters)" for q, n, p in functions()
            if len(p) > MAX_PARAMS and (not n.name.startswith("_") or n.name == "__init__") and not excepted(q)]
    assert not long, f"functions over {MAX_LINES} lines: {long}"
    assert not wide, f"public functions and constructors over {MAX_PARAMS} parameters: {wide}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offload,prefetch", [("auto", 1), ("disk", 2), ("ram", 0)])
def test_the_scheduler_and_the_cost_model_resolve_one_layout(small_store, small_store_bf16, dtype, offload, prefetch):
    """The scheduler's layout (from a store) and the cost model's (from the config alone) are the same
    placement.Layout for stores in fp32 and bf16 computed in fp32, bf16 and fp16."""
    from phantom.plan import costinputs as ci, costmodel as cm
    from phantom.stream.placement import Layout, Placement
    from phantom.stream.scheduler import BlockScheduler
    from phantom.files.store import BlockStore
    from phantom.files.tensorfile import dtype_name
    for path in (small_store, small_store_bf16):
        store = BlockStore(path)
        place = Placement(offload=offload, prefetch=prefetch, ram_budget=3 * store.block_nbytes * 2)
        with BlockScheduler(store, "cpu", place, dtype=dtype) as sched:
            shape = ci.shape_of(store.cfg, store.manifest["dtype"], dtype_name(dtype))
            planned = cm.layout(shape, ci.MachineProfile(machine="t", device="cpu"), place)
            assert isinstance(sched.layout, Layout) and sched.layout == planned, (path.name, dtype)
