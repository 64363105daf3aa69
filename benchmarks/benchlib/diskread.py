"""--modes diskread: the disk tier's first pass (checksums included) raced against raw O_DIRECT reads
of the same files, then half the blocks in RAM against pure disk, beside the cost model."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import phantom
import phantom.base.checksum
import phantom.base.fileio
import phantom.files.directio
import phantom.files.storeformat
import phantom.files.workingcopy
from benchlib.common import lora_steps, machine, shell
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name
from phantom.plan import costinputs as ci
from phantom.plan import costmodel as cm


def raw_read_gbps(store: BlockStore, threads: int, chunk: int, huge: bool = True) -> float:
    """The drive's best case: every block's data read once with O_DIRECT, `threads` requests of `chunk`
    bytes in flight, no checksum and no scheduler. Only the 4 KiB-aligned part of each block is read,
    into fresh memory as the tier's HostBuffers (huge pages), or with huge=False into 4 KiB pages."""
    from concurrent.futures import ThreadPoolExecutor

    from phantom.files.tensorfile import DATA_ALIGN
    from phantom.stream.hostmem import HostBuffer, aligned_memory
    sizes = [e.nbytes // DATA_ALIGN * DATA_ALIGN for e in store.blocks]
    # fresh memory, as a tier pass's fresh slots
    host = HostBuffer(sum(sizes), pin=False).tensor if huge else aligned_memory(sum(sizes))
    host.fill_(0)  # pages faulted in before the clock starts, as the tier's slots (tier_pass_gbps)
    buf = host.numpy()
    fds = [os.open(e.path, os.O_RDONLY | os.O_DIRECT) for e in store.blocks]
    jobs, pos = [], 0
    for fd, e, n in zip(fds, store.blocks, sizes):
        jobs += [(fd, e.data_start + a, pos + a, min(chunk, n - a)) for a in range(0, n, chunk)]
        pos += n

    def read(job):
        fd, off, at, n = job
        got = 0
        while got < n:
            if not (r := os.preadv(fd, [memoryview(buf[at + got: at + n])], off + got)):
                raise OSError(f"{fd}: short read at {off + got}")
            got += r
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
        return sum(sizes) / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def tier_pass_gbps(store: BlockStore, prefetch: int) -> float:
    """The disk tier's achieved rate: a fresh scheduler streams every block in order with nothing to
    compute, until its loaders and checksum threads are done (close). On a store opened with verify
    fast the first pass checks each block's checksum: that time is in the figure. As for the raw read,
    the clock starts once the destination memory (the slots, allocated once per run) is faulted in."""
    from phantom.stream.scheduler import BlockScheduler
    n = store.n_blocks
    with BlockScheduler(store, "cpu", phantom.Placement(offload="disk", prefetch=prefetch)) as sched:
        for slot in sched.slots:
            slot.buf.fill_(0)
        t0 = time.perf_counter()
        sched.plan(list(range(n)))
        for i in range(n):
            sched.acquire(i)
            sched.release(i)
    return n * store.block_nbytes / (time.perf_counter() - t0) / 1e9


def tier_steps(store_path: str, placement, args) -> dict:
    """Step times and per-step tier traffic of LoRA steps (lora_steps)."""
    times, metrics, tiers = lora_steps(BlockStore(store_path), placement, args.batch_size, args.seq_len, args)
    return {"times": times, "tiers": tiers, "stall": [m["stall_s"] for m in metrics],
            "bytes_read": [m["bytes_read"] for m in metrics], "bytes_ram": [m["bytes_ram"] for m in metrics]}


def diskread(args, store: BlockStore, rounds: int = 3, read_rounds: int = 21) -> str:
    """Mode diskread: the disk tier's cold read rate against the best raw read of the same
    files, into fresh huge-page memory as the tier's buffers (also into 4 KiB pages, a row of its own)
    (first pass: verify fast checks each block's crc32 record, with ISA-L's crc32 where the isal
    package is installed and with zlib's; also on the same files under a manifest without crc32, where it
    checks sha256 as on older stores; again: nothing left to check), then a RAM budget of half the
    blocks against pure disk, measured and as the cost model predicts. The drive and the CPU are shared,
    so each comparison is made in rounds (`read_rounds` for the reads, `rounds` for the steps) that
    alternate the contenders, and medians are compared. The cost model gets this run's disk-tier
    rate and a compute rate fitted to the all-RAM row; its two streamed predictions are out of sample."""
    k = int(args.prefetch.split(",")[0])
    refuse_without_direct_reads(store)
    load = [shell("uptime")]
    race = read_race(store, k, read_rounds)
    print(f"raw {race['rate']['raw']:.2f} GB/s ({race['best'][0]} threads x {race['best'][1] >> 20} MiB); disk tier "
          f"first pass {race['rate']['first']:.2f} ({race['checked']}), again {race['rate']['again']:.2f}", flush=True)
    half = (store.n_blocks // 2) * store.block_nbytes + store.block_nbytes // 2
    places = {"ram": phantom.Placement(offload="ram", prefetch=k),
              "disk": phantom.Placement(offload="disk", prefetch=k),
              "half": phantom.Placement(offload="auto", prefetch=k, ram_budget=half)}
    runs = step_race(args, places, rounds)
    load.append(shell("uptime"))
    return "\n".join(diskread_lines(args, store, race, runs, places, load, (rounds, read_rounds))) + "\n"


def refuse_without_direct_reads(store: BlockStore) -> None:
    """Exit 2 where the store's filesystem has no O_DIRECT (nothing to measure); a note where the
    blocks are too small to be read with it."""
    if not hasattr(os, "O_DIRECT") or phantom.files.directio._open_direct(store.blocks[0].path) is None:
        print(f"error: {store.path} is on a filesystem without O_DIRECT; put the store (--store, or run from a "
              f"folder) on the drive to measure", file=sys.stderr)
        sys.exit(2)
    if store.block_nbytes < phantom.files.directio.READ_CHUNK:
        print(f"note: blocks of {store.block_nbytes >> 20} MiB are read buffered (O_DIRECT from "
              f"{phantom.files.directio.READ_CHUNK >> 20} MiB); use a larger --dim to measure the drive", file=sys.stderr)


def read_race(store: BlockStore, k: int, read_rounds: int) -> dict:
    """The raw read grid, then the best raw read against the disk tier's passes, in rotating rounds."""
    grid = {(t, c << 20): raw_read_gbps(store, t, c << 20) for t in (1, 2, 4, 8) for c in (4, 16)}
    best = max(grid, key=grid.get)  # the raw read's best configuration, then raced against the tier
    crc = store.blocks[0].crc
    checked = (f"crc32 ({phantom.base.checksum.CRC32}) of each {crc[0] >> 20} MiB, hashed by the read's threads"
               if crc is not None else "sha256 (this store's manifest has no crc32)")
    old = Path(tempfile.mkdtemp(dir=store.path.parent, prefix=".diskread-")) if crc is not None else None
    try:
        if old is not None:
            without_crc32(store, old / "store")
        contenders = read_contenders(store, best, k, old)
        rates = {key: [] for key in contenders}
        order = list(contenders)
        for r in range(read_rounds):  # A B C D, B C D A, ...: each contender in each place, after each other one
            for key in order[r % len(order):] + order[:r % len(order)]:
                rates[key].append(contenders[key]())
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    rate = {key: statistics.median(v) for key, v in rates.items()}
    return {"grid": grid, "best": best, "checked": checked, "rates": rates, "rate": rate}


def without_crc32(store: BlockStore, copy: Path) -> None:
    """The same files (hard links) under a manifest without crc32 records: a store as older versions wrote it."""
    phantom.files.workingcopy.link_tree(store.path, copy)
    m = json.loads((copy / phantom.files.storeformat.MANIFEST).read_text())
    for info in [*m["files"].values(), *m.get("links", {}).get("files", {}).values()]:
        info.pop("crc32", None)
    phantom.base.fileio.atomic_write_json(copy / phantom.files.storeformat.MANIFEST, m)  # a new file, not the link


def read_contenders(store: BlockStore, best: tuple, k: int, old: Path | None) -> dict:
    """name -> a function that reads the whole store once and returns its GB/s."""
    contenders = {"raw": lambda: raw_read_gbps(store, *best),
                  "plain": lambda: raw_read_gbps(store, *best, huge=False),  # into 4 KiB pages
                  "first": lambda: tier_pass_gbps(BlockStore(store.path, verify="fast"), k)}  # reads + checksums
    if old is not None and phantom.base.checksum.CRC32 != "zlib":  # the first pass where isal is not installed
        contenders["zlib"] = lambda: tier_pass_gbps(BlockStore(store.path, verify="fast", crc32="zlib"), k)
    if old is not None:
        contenders["sha256"] = lambda: tier_pass_gbps(BlockStore(old / "store", verify="fast"), k)  # + sha256
    contenders["again"] = lambda: tier_pass_gbps(BlockStore(store.path, verify="none"), k)  # the drive again
    return contenders


def step_race(args, places: dict, rounds: int) -> dict[str, dict]:
    """LoRA steps of each placement, the placements alternated round by round."""
    runs: dict[str, dict] = {}
    for _ in range(rounds):
        for name, place in places.items():
            r = tier_steps(args.store, place, args)
            for key in ("times", "stall", "bytes_read", "bytes_ram"):
                runs.setdefault(name, {"tiers": r["tiers"]}).setdefault(key, []).extend(r[key])
    for name, r in runs.items():
        print(f"{name:5s} {statistics.median(r['times']):.3f} s/step, "
              f"{statistics.median(r['bytes_read']) / 1e6:.0f} MB read/step", flush=True)
    return runs


READ_ROWS = {"raw": "raw O_DIRECT, best of the grid below: {t} threads x {c} MiB, no checksum",
             "plain": "raw O_DIRECT as above, into 4 KiB pages (no huge pages: the buffers before)",
             "first": "disk tier, first pass (verify fast: {checked})",
             "zlib": "disk tier, first pass, crc32 by zlib (the isal package not installed)",
             "sha256": "disk tier, first pass, same files, manifest without crc32 (verify fast: sha256, as older "
                       "stores)",
             "again": "disk tier, again (nothing left to verify)"}


def predictions(args, store: BlockStore, places: dict, race: dict, step: dict) -> tuple:
    """The cost model's step per placement, its compute rate fitted to the all-RAM row and its disk rate
    the tier's second pass in this run: the two streamed predictions are out of sample."""
    dt = dtype_name(store.dtype)
    shape = ci.shape_of(store.cfg, dt, dt, args.seq_len)
    acts = phantom.Activations(recompute="none")
    unit = ci.MachineProfile(machine="bench", device="cpu", dtype=dt, disk_gbps=race["rate"]["again"], fwd_flops=1e12)
    profile = dataclasses.replace(unit, fwd_flops=1e12 * cm.predict(unit, shape, places["ram"], acts,
                                                                     args.batch_size).step_s / step["ram"])
    return profile, {name: cm.predict(profile, shape, place, acts, args.batch_size) for name, place in places.items()}


def diskread_lines(args, store: BlockStore, race: dict, runs: dict, places: dict, load: list,
                   rounds: tuple[int, int]) -> list[str]:
    """The note: the machine, the read table, the placement table, the ratios."""
    k, cfg, nb, tok = int(args.prefetch.split(",")[0]), store.cfg, store.block_nbytes, args.batch_size * args.seq_len
    rates, rate, (t, c) = race["rates"], race["rate"], race["best"]
    step = {name: statistics.median(r["times"]) for name, r in runs.items()}
    profile, pred = predictions(args, store, places, race, step)
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
             f"(torch threads {torch.get_num_threads()})",
             "- `lscpu | head`: " + "; ".join(" ".join(l.split()) for l in shell("lscpu | head -n 8").splitlines()),
             f"- store: {store.path.parent} on `{' '.join(shell(f'df -T {store.path} | tail -1').split())}` "
             f"(device, type, 1K-blocks, used, available, use%, mount)",
             f"- load: before `{load[0]}`; after `{load[1]}`",
             f"- model: dim {cfg.dim}, {store.n_blocks} blocks of {nb / 2**20:.1f} MiB ({dtype_name(store.dtype)}), "
             f"{tok} tokens per step ({args.batch_size} x {args.seq_len}), prefetch {k}, LoRA rank {args.lora_rank}, "
             f"recompute none; {rounds[1]} rounds of reads (the contenders' order rotated each round) and "
             f"{rounds[0]} of steps, medians", "",
             "| read (whole store, every block once) | GB/s per round | median | vs raw |", "|---|---|---|---|",
             *(f"| {READ_ROWS[key].format(t=t, c=c >> 20, checked=race['checked'])} | "
               f"{' '.join(f'{x:.2f}' for x in rates[key])} | {rate[key]:.2f} | {rate[key] / rate['raw']:.2f} |"
               for key in READ_ROWS if key in rate), "",
             "- raw grid (threads x MiB: GB/s): " + ", ".join(f"{t}x{c >> 20}: {r:.2f}" for (t, c), r in race["grid"].items()),
             "", "| placement | tiers device/RAM/disk | step s (median) | predicted s | MB read/step | predicted MB "
             "| MB from RAM/step | stall |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        p, split = pred[name], "/".join(str(r["tiers"].count(t)) for t in ("device", "ram", "disk"))
        lines.append(f"| {name} | {split} | {step[name]:.3f} | {p.step_s:.3f}{' (fitted)' if name == 'ram' else ''} | "
                     f"{statistics.median(r['bytes_read']) / 1e6:.0f} | {p.bytes_read / 1e6:.0f} | "
                     f"{statistics.median(r['bytes_ram']) / 1e6:.0f} | "
                     f"{statistics.median(r['stall']) / step[name]:.0%} |")
    return lines + ratio_lines(race, runs, step, pred, profile)


def ratio_lines(race: dict, runs: dict, step: dict, pred: dict, profile) -> list[str]:
    """The read ratios against raw, half RAM against disk, and the prediction errors."""
    rates, rate = race["rates"], race["rate"]
    raw_best = max(rate["raw"], max(race["grid"].values()))
    fall, pfall = step["half"] / step["disk"], pred["half"].step_s / pred["disk"].step_s
    read = statistics.median(runs["half"]["bytes_read"]) / statistics.median(runs["disk"]["bytes_read"])
    paired = statistics.median(f / r for f, r in zip(rates["first"], rates["raw"]))  # the same round: seconds apart
    return ["", f"- disk tier first pass / raw = {rate['first'] / rate['raw']:.2f} (the aim: >= 0.9); the "
                f"median of each round's first pass / raw: {paired:.2f}; against "
                f"the best single raw figure of the run ({raw_best:.2f}): {rate['first'] / raw_best:.2f}"
                + (f"; with zlib's crc32: {rate['zlib'] / rate['raw']:.2f}" if "zlib" in rate else "")
                + (f"; with sha256 instead of crc32: {rate['sha256'] / rate['raw']:.2f}" if "sha256" in rate else ""),
            f"- half RAM / disk: step time x{fall:.2f} measured, x{pfall:.2f} predicted ({fall / pfall - 1:+.1%}); "
            f"bytes read x{read:.2f} measured, x{pred['half'].bytes_read / pred['disk'].bytes_read:.2f} predicted",
            f"- prediction error (measured / predicted - 1): disk {step['disk'] / pred['disk'].step_s - 1:+.1%}, "
            f"half {step['half'] / pred['half'].step_s - 1:+.1%}; compute fitted to the ram row "
            f"({profile.fwd_flops / 1e9:.0f} GFLOP/s), disk {rate['again']:.2f} GB/s from the tier's second pass"]
