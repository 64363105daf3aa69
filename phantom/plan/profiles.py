"""Measuring this machine for the cost model, and the profiles of its rates kept on disk.

`measure` times this machine on a store's first blocks (reads, the host-to-device link, one block's
compute through phantom.plan.computetimer, free memory) and returns a `ci.MachineProfile` of rates, so
a profile measured on a few blocks plans a whole model, and any model of the same block shape. A quick
profile times a block's compute on a slice of it (phantom.plan.quickslice), in bounded time. `probe` measures a shape that
has no weights yet on a few synthetic blocks. Apart from phantom.plan.tune, which chooses a placement
from a profile: the clocks, the reader threads and the profile files are here, the choice is not.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from phantom.arch.quantformat import as_format
from phantom.base import cpufeatures, dtypes, safejson
from phantom.base.fileio import atomic_write_json
from phantom.files.directio import readinto_exact
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name, parse_dtype
from phantom.convert.synthetic import write_synthetic
from phantom.plan import computetimer as ct
from phantom.plan import costinputs as ci
from phantom.plan import quickslice as qs
from phantom.stream.experts import ExpertLayout, read_ranges
from phantom.stream.hostmem import HostBuffer
from phantom.stream.memory import free_device_bytes, free_host_bytes
from phantom.stream.transfer import DequantPool

log = logging.getLogger(__name__)

PROFILE_VERSION = 3  # 1: per-model times (before the cost model took rates); 2: before expert reads, graphs
# timed one at a time and the read jitter as a quartile spread
PROBE_BLOCKS = 2  # synthetic blocks `probe` writes to measure a shape without weights
MEASURED_TOKENS = 2048  # the longest row a profile times: a longer one is planned from its rates per FLOP and
# byte (a 70B block's forward over 131072 tokens is ~60 PFLOP, hours on a CPU), attention's T^2 term in its FLOPs


def measured_tokens(seq_len: int) -> int:
    """Tokens a row is timed at for a profile of rows of seq_len tokens."""
    return min(seq_len, MEASURED_TOKENS)


# ---------------------------------------------------------------------------------------------
# Measuring

def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (posix_fadvise DONTNEED, no root needed): its next read is cold."""
    if hasattr(os, "posix_fadvise"):
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure_disk(store: BlockStore, max_bytes: int = 1 << 30, passes: int = 2,
                 readers: int = 2) -> tuple[float, float]:
    """GB/s of block reads as the disk tier does them, and the relative spread of one block's read.

    Each file is dropped from the page cache first (posix_fadvise DONTNEED, no root needed), then read
    into an aligned buffer (O_DIRECT where the filesystem allows) by `readers` threads at once, as the
    scheduler's loaders read: the disk tier's access is cyclic over a store larger than the cache, so
    cold reads are what it gets. The spread is of the same reads made by one thread after: with two
    at once a read takes the whole disk or half of it as the other starts or ends, and that 2x is no
    read's jitter.
    """
    k = max(2, min(store.n_blocks, max_bytes // max(store.block_nbytes, 1)))
    entries = store.blocks[:k] * passes
    times, lock = [], threading.Lock()

    def read(mine: list) -> None:
        buf = HostBuffer(store.block_nbytes, pin=False).tensor  # what the scheduler reads into
        for e in mine:
            evict(e.path)
            t0 = time.perf_counter()
            readinto_exact(e.path, e.data_start, buf[: e.nbytes])
            with lock:
                times.append(time.perf_counter() - t0)

    def run(n: int) -> float:
        threads = [threading.Thread(target=read, args=(entries[r::n],), name=f"phantom-tune-disk{r}")
                   for r in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(times) != len(entries):
            raise OSError(f"reading {store.path} failed while measuring the disk (see the log)")
        return time.perf_counter() - t0

    wall = run(readers)
    times.clear()
    run(1)
    return sum(e.nbytes for e in entries) / wall / 1e9, relative_spread(times)


def relative_spread(times: list[float]) -> float:
    """The relative std of the reads as a normal spread's quartiles give it (IQR / 1.349 / median): the
    steady variation a prefetch depth must absorb. pstdev / mean let one read stalled by other work
    (4x the rest, among a dozen) triple it, and the jitter term with it."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / 1.349 / statistics.median(times)


def measure_disk_requests(store: BlockStore, disk_gbps: float, max_bytes: int = 1 << 30,
                          passes: int = 2) -> float | None:
    """Seconds a read request costs beside its bytes (at disk_gbps), as routed expert reads make them: every
    other expert of a few blocks, cold, an expert's range each, several in flight
    (phantom.stream.experts.read_ranges). A routed read of few experts is mostly these. None where the store
    reads no experts apart (a dense model, a quantized store without expert ranges)."""
    try:
        lay = ExpertLayout.of_store(store)
    except ValueError:
        return None
    sparse = [i for i in range(store.n_blocks) if store.cfg.sparse(i)]
    k = max(1, min(len(sparse), max_bytes // max(store.block_nbytes, 1)))
    buf = HostBuffer(store.block_nbytes, pin=False).tensor
    nbytes, secs, requests = 0, 0.0, 0
    for p in range(passes):
        for i in sparse[:k]:
            ranges = lay.at(store.layout_index(i)).of(range(p % 2, lay.n_experts, 2))
            evict(store.blocks[i].path)
            t0 = time.perf_counter()
            nbytes += read_ranges(store.blocks[i], buf, ranges)
            secs += time.perf_counter() - t0
            requests += len(ranges)
    return max(0.0, secs - nbytes / (disk_gbps * 1e9)) / requests


def measure_link(device: torch.device, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """Host-to-device and device-to-host GB/s with pinned host buffers (a host memcpy on a CPU)."""
    nbytes = max(1 << 20, min(nbytes, 256 << 20))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = ct.timed(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    d2h = ct.timed(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def store_quant(store: BlockStore) -> str | None:
    """The cost model's name of how a store's linear weights are stored: None (16-bit), "nf4", "int8"."""
    return store.quant.method if store.quant is not None else None


def measure_dequant(store: BlockStore, device: torch.device, dtype: torch.dtype, repeats: int = 3,
                    sample_s: float = 1.5) -> float:
    """GB/s of compute-dtype weights produced dequantizing a quantized block, as the scheduler does it (the
    block's stored bytes already where it computes; on a CPU over its cores, DequantPool). The block is a
    sparse one where dense layers sit among a mixture of experts' (the experts: what a shipped 4-bit format
    quantizes), read, viewed and dequantized in its own layout.

    The mean of at least `repeats` calls, more until `sample_s` seconds (up to 20): a step adds up one
    dequantization per load, and on a shared CPU one call's time spreads widely (a dim-2048 int4-group block:
    59-132 ms over 30 calls in a row, medians of 3 of them 65-110). On a CPU the block is read again before
    each call, as the store reads it (O_DIRECT where it drops the cache): a run dequantizes bytes just read,
    and a dim-2048 fp8-block block took 1.5x as long from a fresh O_DIRECT read (58-64 ms) as dequantized
    again from the same bytes (38 ms), where a run's loads took 51-71 ms."""
    i = next((j for j in range(store.n_blocks) if store.cfg.sparse(j)), 0)
    raw = HostBuffer(store.block_nbytes, pin=False).tensor
    store.read_block_into(i, raw)
    stored = store.block_views(raw.to(device), i)
    out = store.dense_empty(dtype, device, i)
    pool = DequantPool(torch.get_num_threads() if device.type == "cpu" else 1)
    fresh = (lambda: store.read_block_into(i, raw)) if device.type == "cpu" else None  # as a run: just read
    try:
        t = ct.timed_mean(lambda: pool.dequantize(store, i, stored, out), device, repeats, sample_s, 20, fresh)
    finally:
        pool.close()
    return sum(v.numel() for v in out.values()) * dtype.itemsize / t / 1e9


def measure(store: BlockStore, device: torch.device | str, dtype: torch.dtype | str, batch_size: int,
            seq_len: int, quick: bool = False, cfg=None) -> ci.MachineProfile:
    """Measure this machine on a store's blocks: disk, link, one block's compute, free memory, as rates.

    Times become rates through the store's `ci.Shape` (FLOPs per row, kept bytes), so the
    profile predicts any model whose blocks have this shape, at any depth.

    Args:
        store: a store of the model (or of a few blocks of its shape).
        device: where blocks compute.
        dtype: compute dtype.
        batch_size: rows per step; compute is measured at 1 row and at the largest power of two
            that divides it (and fits), which gives the per-call and per-row costs.
        seq_len: tokens per row.
        quick: fewer repeats, a smaller read sample and a block's compute timed on a slice of it where
            the whole block would take long (what `auto_placement` runs without a profile).
        cfg: the model the profile is for, where `store` holds blocks of a slice of it (`probe`);
            default: the store's own.
    """
    cfg, seq_len = cfg or store.cfg, measured_tokens(seq_len)
    device, dtype = torch.device(device), parse_dtype(dtype)
    repeats = qs.QUICK_REPEATS if quick else 4
    t0 = time.perf_counter()
    disk, jitter, request_s = disk_rates(store, quick)
    h2d, _ = measure_link(device, store.block_nbytes, repeats)
    free_dev = free_device_bytes(device)
    shape = ci.shape_of(cfg, store.manifest["dtype"], dtype_name(dtype), seq_len, store.quant)
    with compute_stores(store, cfg, device, dtype, (batch_size, seq_len), quick) as timed:
        itself = timed == [(store, seq_len)]  # the store's own block at the row's length: at 1 row and batch_size
        beside = ct.Beside(disk, True, window_s=0.0 if quick else 0.5)  # quick: over its four reads alone
        points = [(ct.measure_compute(s, device, dtype, t, batch_size if itself else 1,
                                      free_dev, repeats, beside if i == 0 else ct.Beside()),
                   ci.shape_of(s.cfg, store.manifest["dtype"], dtype_name(dtype), t, store.quant))
                  for i, (s, t) in enumerate(timed)]
        sliced = "" if itself else " (compute timed on " + " and ".join(
            f"f{s.cfg.hidden_dim}-h{s.cfg.n_heads}" + (f" x {t} tokens" if t != seq_len else "") for s, t in timed) + ")"
    dequant = measure_dequant(store, device, dtype, repeats, 0.5 if quick else 1.5) if store.quant is not None else \
        ci.MachineProfile.dequant_gbps
    log.info("measured a %s in %.1f s", "quick profile" if quick else "profile", time.perf_counter() - t0)
    return ci.MachineProfile(
        machine=machine_key(device), device=device.type, dtype=dtype_name(dtype), disk_gbps=disk,
        disk_request_s=request_s,
        disk_warm_gbps=None, h2d_gbps=h2d, dequant_gbps=dequant, **compute_rates(qs.scaled_times(points, shape), shape),
        disk_jitter=jitter,
        free_device_bytes=free_dev, free_host_bytes=free_host_bytes(), quick=quick,
        measured_on=f"{shape_key(cfg, store.manifest['dtype'], store_quant(store))} x {seq_len} tokens{sliced}",
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


def disk_rates(store: BlockStore, quick: bool = True) -> tuple[float, float, float | None]:
    """The disk tier's rates on a store's blocks: cold GB/s, one read's spread, a request's seconds
    (measure_disk, measure_disk_requests; quick: a smaller sample, one pass)."""
    sample = (256 << 20) if quick else (1 << 30)
    disk, jitter = measure_disk(store, sample, 1 if quick else 3)
    return disk, jitter, measure_disk_requests(store, disk, sample, 1 if quick else 2)


def compute_rates(c: dict, shape: ci.Shape) -> dict:
    """A profile's compute fields from ct.measure_compute's times of a block of `shape`: per FLOP, per byte
    and per call, so they hold for any block of that width (the whole one, where a slice was timed)."""
    return dict(fwd_flops=shape.flops_per_row / c["fwd_row_s"], fwd_grad_ratio=c["fwd_grad_row_s"] / c["fwd_row_s"],
                bwd_ratio=c["bwd_row_s"] / c["fwd_row_s"], fwd_call_s=c["fwd_call_s"],
                fwd_grad_call_s=c["fwd_grad_call_s"], bwd_call_s=c["bwd_call_s"],
                head_flops=shape.head_flops_per_row / c["head_row_s"],
                keep_scale=c["keep_bytes_per_row"] / shape.keep_bytes_per_row,
                busy_compute_slowdown=c["busy_compute_slowdown"], busy_read_slowdown=c["busy_read_slowdown"])


@contextlib.contextmanager
def compute_stores(store: BlockStore, cfg, device: torch.device, dtype: torch.dtype, rows_tokens: tuple[int, int],
                   quick: bool):
    """(store, tokens a row) for each block 0 a profile times: (store, seq_len) itself, or for a quick profile
    of a block too large to time quickly, what quickslice.points says: one synthetic block of each of two slices
    of cfg's shape (one where there is no second), or where bf16 is emulated on a CPU the whole block over two
    shorter rows, in a temporary folder, stored as `store` is (its dtype, its quantization), timed at one row:
    quickslice.scaled_times scales their times to the whole block. (A block timed whole at seq_len is timed at 1
    row and at the most `rows` allow, as a full profile does.)"""
    (rows, seq_len), rate = rows_tokens, None
    timed = [(1, seq_len)]
    if quick:
        timed, rate = quick_points(cfg, ci.Workload(rows, seq_len, dtype_name(dtype), store.manifest["dtype"],
                                                    store.quant), device, dtype)
    if timed == [(1, seq_len)] and cfg.first_layers(store.cfg.n_layers) == store.cfg:
        yield [(store, seq_len)]
        return
    log.info("timing compute on %s (matmuls at %.1f GFLOP/s here)", " and ".join(
        f"1/{k} of a block" if t == seq_len else f"a block over {t} tokens" for k, t in timed), (rate or 0) / 1e9)
    with tempfile.TemporaryDirectory(prefix="phantom-slice-") as tmp:
        def block_of(k: int) -> BlockStore:  # a timing store: a tiled init writes in half the time
            return BlockStore(write_synthetic(Path(tmp) / f"slice{k}", measurable(qs.slice_config(cfg, k).first_layers(1)),
                                              parse_dtype(store.manifest["dtype"]), progress=False, quant=store.quant,
                                              init="tiled"), verify="none")
        stores = {k: block_of(k) for k in dict.fromkeys(k for k, _ in timed)}
        yield [(stores[k], t) for k, t in timed]


def quick_points(cfg, work: ci.Workload, device: torch.device, dtype: torch.dtype) -> tuple[list, float]:
    """quickslice.points for this machine, and the matmul rate (FLOP/s) they were chosen by: bf16 emulated or
    not told by the CPU's flags and oneDNN's cap."""
    rate = ct.matmul_rate(device, dtype, cfg.dim, work.seq_len)
    emulated = device.type == "cpu" and dtype == torch.bfloat16 and cpufeatures.bf16_emulated() is not None
    return qs.points(cfg, work, rate, emulated), rate


def with_free_memory(profile: ci.MachineProfile, device: torch.device | str) -> ci.MachineProfile:
    """The profile with free memory read now: it changes between runs, the rates do not. Unreachable objects
    are collected first: a measured model's reference cycles held its buffers (a whole fp32 70B block's
    measurement: 5 GB the plan then took for used, and placed otherwise) until the next collection."""
    gc.collect()
    return dataclasses.replace(profile, free_device_bytes=free_device_bytes(torch.device(device)),
                               free_host_bytes=free_host_bytes())


def free_disk_bytes(path: Path | str) -> int:
    """Free bytes on the filesystem that holds path (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


# ---------------------------------------------------------------------------------------------
# Profiles on disk: one per machine, compute dtype and block shape

def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


def machine_key(device: torch.device | str) -> str:
    """Host name and device name, e.g. `box-nvidia-h100-80gb-hbm3`, `box-cpu-2c` or (ONEDNN_MAX_CPU_ISA set)
    `box-cpu-2c-avx512-core`."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"mps-{platform.machine()}"
    else:  # oneDNN's ISA cap changes the rates (it may keep bf16 instructions from oneDNN): a machine of its own
        name = f"cpu-{os.cpu_count()}c" + (f"-{cap}" if (cap := cpufeatures.isa_cap()) else "")
    return _slug(f"{socket.gethostname()}-{name}")


def shape_key(cfg, store_dtype: str, quant: str | None = None) -> str:
    """What a block's cost depends on, not the depth: e.g. `d8192-f28672-h64-kv8-v32000-bfloat16-1a2b3c`
    (a quantized store: `...-nf4-...`)."""
    parts = dict(dim=cfg.dim, hidden=cfg.hidden_dim, heads=cfg.n_heads, kv=cfg.kv_heads, vocab=cfg.vocab_size,
                 dtype=dtypes.lookup(store_dtype).torch_name + (f"-{as_format(quant).method}" if quant else ""))
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:6]
    return _slug(f"d{cfg.dim}-f{cfg.hidden_dim}-h{cfg.n_heads}-kv{cfg.kv_heads}-v{cfg.vocab_size}-"
                 f"{parts['dtype']}-{digest}")


def profile_dir_default() -> Path:
    return Path(os.environ.get("PHANTOM_CACHE") or Path.home() / ".cache" / "phantom") / "profiles"


def profile_path(model, device, dtype, seq_len: int, profile_dir: Path | str | None = None,
                 store_dtype: str | None = None, quant: str | None = None) -> Path:
    """<profile_dir or $PHANTOM_CACHE/profiles or ~/.cache/phantom/profiles>/<machine>-<dtype>-<shape>-t<tokens>.json

    A profile is kept per power of two of tokens per row (`length_bucket`): a block's rate per FLOP moves with
    the row's length (its activations outgrow the caches, attention's T^2 and a delta rule's chunk loop run at
    their own rates), so rows of 2048 tokens are planned from a block timed at about that length, not at 128; rows
    longer than MEASURED_TOKENS share the profile timed at it.

    Args:
        model: a BlockStore, or a ModelConfig (with store_dtype and quant: how its store would be stored).
    """
    if isinstance(model, BlockStore):
        cfg, store_dtype, quant = model.cfg, model.manifest["dtype"], store_quant(model)
    else:
        cfg, store_dtype = model, store_dtype or "bf16"
    name = f"{machine_key(device)}-{dtypes.lookup(dtype).torch_name}-{shape_key(cfg, store_dtype, quant)}" \
        f"-t{length_bucket(measured_tokens(seq_len))}.json"
    return Path(profile_dir or profile_dir_default()) / name


def length_bucket(seq_len: int) -> int:
    """The power of two nearest seq_len (in ratio): rows within ~1.4x of each other share a profile."""
    return 1 << max(0, round(math.log2(max(1, seq_len))))


def save_profile(profile: ci.MachineProfile, path: Path) -> None:
    """Atomic (temporary file, fsync, rename): processes measuring at once leave one whole profile. A profile
    derived from a datasheet (phantom.plan.gpusheets) is refused: what is saved is read back as measured."""
    if profile.datasheet:
        raise ValueError(f"a profile from the datasheet of {profile.datasheet} is not measured: not saved")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"version": PROFILE_VERSION, **profile.to_dict()})


def load_profile(path: Path) -> ci.MachineProfile | None:
    """The profile at path, or None if there is none or it is unreadable (it is then measured again)."""
    try:
        d = safejson.load(path)
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')} is not {PROFILE_VERSION}")
        if d.get("datasheet"):
            raise ValueError(f"it is derived from the datasheet of {d['datasheet']}, not measured")
        return ci.MachineProfile.from_dict(d)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("ignoring profile %s (%s)", path, e)
        return None


def profile_for(store: BlockStore, device, dtype, batch_size: int, seq_len: int,
                profile_dir: Path | str | None = None, quick: bool = True,
                remeasure: bool = False) -> ci.MachineProfile:
    """The saved profile for this store's block shape, or one measured on it now (and saved)."""
    path = profile_path(store, device, dtype, seq_len, profile_dir)
    profile = None if remeasure else load_profile(path)
    if profile is None:
        log.info("no tuning profile at %s: measuring %s", path,
                 "a quick one (python scripts/tune.py for a full one)" if quick else "one")
        profile = measure(store, device, dtype, batch_size, seq_len, quick=quick)
        save_profile(profile, path)
    return with_free_memory(profile, device)


PROBE_BLOCK_BYTES = 4 << 30  # the largest block a probe writes, dense in fp32 (it holds it so while timing it)


def measurable(cfg, limit: int = PROBE_BLOCK_BYTES, dtype: str = "fp32") -> "object":
    """cfg with few enough experts that a block, dense in fp32 (the slot a quantized one is dequantized into),
    fits PROBE_BLOCK_BYTES (DeepSeek-V3's is 46 GB): the rates a profile keeps (bytes/s, FLOP/s, a request's
    cost) are the same on fewer experts of that shape. (`limit` bytes in `dtype`: another bound.)"""
    n, g = cfg.n_experts, cfg.router_groups
    least = -(-cfg.experts_per_token * g // cfg.router_topk_groups // g) * g  # the chosen groups hold k experts
    while n - g >= least and ci.shape_of(dataclasses.replace(cfg, n_experts=n), dtype).block_bytes > limit:
        n -= g
    if n < cfg.n_experts:
        log.info("measuring blocks of %d experts of this shape (%d would make a block past %.1f GiB in %s)", n,
                 cfg.n_experts, limit / 2**30, dtype)
    return dataclasses.replace(cfg, n_experts=n)


def probe(cfg, device, work: ci.Workload, profile_dir: Path | str | None = None, quick: bool = True,
          remeasure: bool = False, blocks: int = PROBE_BLOCKS) -> ci.MachineProfile:
    """The profile for a model that has no weights here: measured on `blocks` synthetic blocks of its shape
    (stored as work.store_dtype and work.quant), computing in work.dtype.

    The blocks are written to a temporary folder beside the profiles (the disk a store would use)
    and removed after; the profile is saved, so the next plan for this shape measures nothing. A quick
    profile writes blocks of a slice of the shape (quickslice.slice_factor: the whole block where it
    times quickly) to read, and times compute as `measure` does for the whole shape (on its slices).
    """
    dtype, store_dtype, quant = work.dtype, work.store_dtype, work.quant
    work = dataclasses.replace(work, seq_len=measured_tokens(work.seq_len))
    path = profile_path(cfg, device, dtype, work.seq_len, profile_dir, store_dtype, quant)
    profile = None if remeasure else load_profile(path)
    if profile is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="probe-", dir=path.parent) as tmp:
            k = qs.slice_factor(cfg, work, ct.matmul_rate(torch.device(device), parse_dtype(dtype), cfg.dim,
                                                          work.seq_len)) if quick else 1
            small = measurable(qs.slice_config(cfg, k).first_layers(min(blocks, cfg.n_layers)))
            log.info("writing %d synthetic blocks of this shape to measure them (%.1f GiB)", small.n_layers,
                     ci.shape_of(small, store_dtype, quant=quant).store_bytes / 2**30)
            store = BlockStore(write_synthetic(Path(tmp) / "store", small, parse_dtype(store_dtype), progress=False,
                                               quant=as_format(quant), init="tiled"), verify="none")
            profile = measure(store, device, dtype, work.rows, work.seq_len, quick=quick, cfg=cfg)
        save_profile(profile, path)
    return with_free_memory(profile, device)


DISK_PROBE_BYTES = 256 << 20  # the largest stored block probe_disk writes: reads of it run at the disk's rate


def probe_disk(cfg, store_dtype: str = "bf16",
               profile_dir: Path | str | None = None) -> tuple[float, float, float | None]:
    """This machine's disk_rates for a model without weights here, where nothing else is measured (a plan for a
    GPU from its datasheet, phantom.plan.gpusheets): PROBE_BLOCKS synthetic blocks of the narrowest even slice
    of cfg's shape, with fewer experts, within DISK_PROBE_BYTES (16-bit: a read's rate is its bytes', whatever
    they hold; its experts' ranges for a request's cost), written to a temporary folder beside the profiles (the
    disk a store would use), read cold, removed."""
    k = 1
    while ci.shape_of(qs.slice_config(cfg, k), store_dtype).block_bytes > DISK_PROBE_BYTES and \
            qs.can_slice(cfg, 2 * k):
        k *= 2
    small = measurable(qs.slice_config(cfg, k).first_layers(min(PROBE_BLOCKS, cfg.n_layers)), DISK_PROBE_BYTES,
                       store_dtype)
    parent = Path(profile_dir or profile_dir_default())
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-disk-", dir=parent) as tmp:
        store = BlockStore(write_synthetic(Path(tmp) / "store", small, parse_dtype(store_dtype), progress=False,
                                           init="tiled"), verify="none")
        return disk_rates(store, quick=True)
