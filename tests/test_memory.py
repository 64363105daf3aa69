"""Memory bound of the disk tier: the peak RSS of a training step grows with about one block, not
with depth. A fresh process per case measures its peak RSS (VmHWM) after two LoRA steps (recompute all,
prefetch 1) on synthetic fp32 stores of N and 2N blocks of ~13 MiB each (the blocks dominate:
embedding and head are small). A RAM-tier run of the 2N store is the control: the same measurement
sees every block when they are all held.

Not `ru_maxrss`: a child started by subprocess (vfork + exec) inherits its parent's peak there, so
after other tests had grown pytest to 335 MiB both disk children read 335 MiB and the test measured
pytest, not them. VmHWM belongs to the process image that exec made.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phantom.arch.config import ModelConfig
from phantom.convert.synthetic import write_synthetic
from phantom.files.store import BlockStore

REPO = Path(__file__).resolve().parent.parent
N = 4
# dim 512, FFN 1536, MHA: 4 * 512^2 + 3 * 512 * 1536 = 3.4M parameters, 13.6 MB fp32 per block
CFG = ModelConfig(dim=512, n_layers=N, n_heads=4, vocab_size=97, multiple_of=512, max_seq_len=64)

CHILD = r"""
import json, resource, sys
import torch
torch.set_num_threads(1)
import phantom
path, offload = sys.argv[1], sys.argv[2]
model = phantom.load(path, offload=offload, prefetch=1, recompute="all", dtype=torch.float32, verify="none")
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 97, (2, 16), generator=gen)
targets = torch.randint(0, 97, (2, 16), generator=gen)
for _ in range(2):
    model(tokens, targets=targets).backward()
model.close()
try:  # this process image's own peak: ru_maxrss also counts the parent's peak (vfork + exec carries it)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"maxrss": peak}))
"""


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    return {n: write_synthetic(root / f"s{n}", dataclasses.replace(CFG, n_layers=n), torch.float32,
                               seed=0, progress=False) for n in (N, 2 * N)}


def peak_rss(cases: list[tuple[Path, str]]) -> list[int]:
    """Peak RSS in bytes of one child per case; run side by side (each its own process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), offload], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for path, offload in cases]
    out = []
    for p, case in zip(procs, cases):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"{case}: exit {p.returncode}\n{stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1])["maxrss"])
    return out


def test_disk_tier_peak_rss_grows_with_one_block_not_with_depth(stores):
    block = BlockStore(stores[N]).block_nbytes
    assert block > 10 * 2**20  # the blocks dominate the measurement
    disk_n, disk_2n, ram_2n = peak_rss([(stores[N], "disk"), (stores[2 * N], "disk"), (stores[2 * N], "ram")])
    mib = {k: round(v / 2**20, 1) for k, v in
           {"block": block, "disk N": disk_n, "disk 2N": disk_2n, "ram 2N": ram_2n}.items()}
    # N more blocks on disk: at most about one more block of peak memory (allocator noise), not N.
    assert disk_2n - disk_n < 1.5 * block, f"disk-tier peak RSS grows with depth: {mib} MiB"
    # The control: holding all 2N blocks shows up as about 2N blocks over the disk tier's 2 slots.
    assert ram_2n - disk_2n > (2 * N - 2) * block * 0.75, f"RSS does not see the blocks held: {mib} MiB"
