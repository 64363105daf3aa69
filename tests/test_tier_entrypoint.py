"""A tier an installed package declares (entry point group `phantom.tiers`) is a choice of finetune.py's
--offload and of a run file's `offload:`, listed by --help, and trains equal to --offload none.

The package is written into tmp_path as an installed distribution would be (a module beside a
`.dist-info` folder with METADATA and entry_points.txt) and put on PYTHONPATH / sys.path, so
importlib.metadata finds it as it finds a pip-installed one: no network, no pip. Its tier holds each
block as an immutable bytes object (as a remote object store's GET returns them) and reads it whole.
A broken or conflicting plugin is one `error:` line and exit 2. The tiny model, fp32; ~15 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from phantom.stream import tiers
from test_convert import load_script

ROOT = Path(__file__).resolve().parent.parent
FINETUNE = ROOT / "scripts" / "finetune.py"
RUN = ["--iters", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--save-every", "0",
       "--dtype", "fp32", "--device", "cpu", "-q"]

TIER_MODULE = '''
import torch
from phantom.stream import tiers


class ObjectStoreTier(tiers.Tier):
    """Blocks held as immutable objects, fetched whole."""

    name = "objstore"
    lane = "object-store"

    def read_s(self, nbytes, profile):
        return 1e-3 + nbytes / 2e9

    def host_bytes(self, n_blocks, block_bytes, shared, host_is_device):
        return n_blocks * block_bytes

    def open(self, ctx, blocks):
        return ObjectStoreHeld(self, ctx, blocks)


class ObjectStoreHeld(tiers.Held):
    def __init__(self, tier, ctx, blocks):
        super().__init__(tier, ctx)
        self.objects = {}
        for i in blocks:
            buf = torch.empty(ctx.store.block_nbytes, dtype=torch.uint8)
            ctx.store.read_block_into(i, buf)
            self.objects[i] = bytes(buf.numpy())

    def read_into(self, block, into):
        into.copy_(torch.frombuffer(bytearray(self.objects[block]), dtype=torch.uint8))
        return None
'''


def install(site: Path, dist: str, module: str, source: str, points: dict[str, str]) -> Path:
    """A distribution `dist` as pip leaves one in site-packages: its module and its dist-info."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[phantom.tiers]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return site


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """sys.path with the given sites in front for this test; the tiers they registered removed after."""
    before = set(tiers.names())

    def prepend(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))
    yield prepend
    for name in set(tiers.names()) - before:
        tiers.unregister(name)
    tiers._loaded.clear()


def finetune(site: Path, out: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    return subprocess.run([sys.executable, str(FINETUNE), *RUN, "--out", str(out), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def trained(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return losses, load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_an_installed_tier_is_chosen_by_flag_and_run_file_and_trains_equal_to_none(tmp_path):
    site = install(tmp_path / "site", "phantom-objtier", "phantom_objtier", TIER_MODULE,
                   {"objstore": "phantom_objtier:ObjectStoreTier"})
    runs = {"none": ["--offload", "none"], "flag": ["--offload", "objstore", "--trace"]}
    (tmp_path / "run.yaml").write_text("placement: {offload: objstore}\n")
    runs["file"] = ["--config", tmp_path / "run.yaml"]
    for name, args in runs.items():
        r = finetune(site, tmp_path / name, *args)
        assert r.returncode == 0, r.stderr
    ref_losses, ref_adapter = trained(tmp_path / "none")
    for name in ("flag", "file"):
        losses, adapter = trained(tmp_path / name)
        assert len(losses) == 3 and losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), name
        assert adapter.keys() == ref_adapter.keys() and adapter
        for k in adapter:
            torch.testing.assert_close(adapter[k], ref_adapter[k], rtol=1e-5, atol=1e-7, msg=f"{name} {k}")
        assert "offload: objstore" in (tmp_path / name / "config.yaml").read_text()
    trace = json.loads((tmp_path / "flag" / "trace.json").read_text())  # its reads are the plugin's lane
    assert "object-store" in {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}

    help_text = subprocess.run([sys.executable, str(FINETUNE), "--help"], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)])),
                               timeout=120).stdout
    assert "{auto,none,ram,disk,objstore}" in help_text


BROKEN = {
    "fails to import": ({"objstore": "phantom_objtier:ObjectStoreTier"}, "raise ImportError('needs boto3')\n",
                        "the tier plugin 'objstore' (objtier_0:ObjectStoreTier, package phantom-objtier) "
                        "failed to load: ImportError: needs boto3"),
    "is not a tier": ({"objstore": "phantom_objtier:thing"}, "thing = 3\n", "gives int, not a phantom.stream"),
    "is misnamed": ({"cloud": "phantom_objtier:ObjectStoreTier"}, TIER_MODULE,
                    "is a tier named 'objstore': the entry point must be named as its tier"),
    "takes a built-in name": ({"disk": "phantom_objtier:DiskAgain"}, TIER_MODULE + "\nclass DiskAgain("
                              "ObjectStoreTier):\n    name = 'disk'\n", "'disk' is a built-in name"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_or_conflicting_plugin_is_one_line_exit_2(case, tmp_path, plugin_path, capsys):
    points, source, match = BROKEN[case]
    module = f"objtier_{list(BROKEN).index(case)}"  # a module of its own: sys.modules keeps the others
    points = {k: v.replace("phantom_objtier", module) for k, v in points.items()}
    plugin_path(install(tmp_path / "site", "phantom-objtier", module, source, points))
    code = load_script("finetune").main([*RUN, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert not (tmp_path / "out").exists()


def test_two_packages_declaring_one_tier_name_is_one_line_exit_2(tmp_path, plugin_path, capsys):
    plugin_path(install(tmp_path / "a", "tier-a", "tier_a", TIER_MODULE, {"objstore": "tier_a:ObjectStoreTier"}))
    plugin_path(install(tmp_path / "b", "tier-b", "tier_b", TIER_MODULE, {"objstore": "tier_b:ObjectStoreTier"}))
    code = load_script("tune").main(["--preset", "tiny", "--offload", "objstore"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "two packages declare a tier named 'objstore'" in err and "tier_a:" in err and "tier_b:" in err
