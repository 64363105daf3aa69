"""Routed expert reads: where a mixture-of-experts block's experts lie in its file, reading only some of
them, the router's measured hits, and the rule that says when reading only the routed experts pays.

A routed load reads a block's non-expert bytes (attention, norms, router, shared expert) ahead of use as
any block is read; after the router has run over the step's tokens, the experts some token routes to are
read into the same slot (on the training thread: the router's answer is needed first). It saves the
bytes of the experts no token picks, and costs the overlap the prefetch gave the expert bytes and a
request for each run of consecutive hit experts (`expected_runs`), each paying the device's latency
beside its bytes; `block_seconds` writes both sides down, the cost model
(phantom.plan.costmodel) and the run's `auto` choice (`ExpertReads`) use it. Imports arch and files only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phantom.arch.moe import expert_ranges
from phantom.files.directio import readinto_pieces
from phantom.files.storeformat import between, block_file
from phantom.files.tensorfile import StoreError

MODES = ("auto", "routed", "whole")


def expected_hits(probs: torch.Tensor | None, tokens: int, n_experts: int, k: int) -> float:
    """Experts a step of `tokens` tokens routes to, expected: sum_e 1 - (1 - p_e)^tokens, p_e the share of
    tokens that pick expert e (the router's measured distribution, summing to k), or k / E for each
    (uniform routing: E * (1 - (1 - k/E)^tokens)) before one is measured."""
    if probs is None:
        return n_experts * (1 - (1 - k / n_experts) ** tokens)
    return float((1 - (1 - probs.double().clamp(0, 1)) ** tokens).sum())


def expected_runs(probs: torch.Tensor | None, tokens: int, n_experts: int, k: int) -> float:
    """Read requests a routed read of the experts a step hits makes, expected: runs of consecutive hit
    experts (touching ranges are read as one), sum_e q_e (1 - q_(e-1)) with q_e = 1 - (1 - p_e)^tokens the
    chance expert e is hit (p as expected_hits). Few for a step that hits nearly every expert, about one an
    expert for a step that hits few."""
    p = torch.full((n_experts,), k / n_experts, dtype=torch.float64) if probs is None else probs.double().clamp(0, 1)
    q = 1 - (1 - p) ** tokens
    return float(q[0] + (q[1:] * (1 - q[:-1])).sum())


def block_seconds(compute_s: float, base_bytes: int, expert_bytes: int, n_experts: int, hits: float,
                  s_per_byte: float, request_s: float, runs: float = 1.0) -> tuple[float, float]:
    """One streamed block's seconds in a prefetched pipeline, (whole, routed): a whole read overlaps the
    compute (max of the two); a routed read overlaps only the non-expert part, then reads the `hits`
    experts after the router, in series with the compute: their bytes, and `request_s` for each of its
    `runs` requests (what one more request costs beside its bytes, with the others in flight)."""
    whole = max(compute_s, (base_bytes + n_experts * expert_bytes) * s_per_byte)
    routed = max(compute_s, base_bytes * s_per_byte) + hits * expert_bytes * s_per_byte + runs * request_s
    return whole, routed


def merge(ranges) -> list[tuple[int, int]]:
    """Sorted [start, end) ranges with touching ones joined (fewer, larger reads)."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a store's experts lie in each block's data section (one layout for every block file).

    ranges: each expert's [start, end); base: the rest (attention, norms, router, shared expert);
    names: each expert's tensor names as the dense block has them (converted to the compute dtype, or
    dequantized, after a routed read)."""

    ranges: tuple[tuple[int, int], ...]
    base: tuple[tuple[int, int], ...]
    names: tuple[tuple[str, ...], ...]
    nbytes: int
    k: int
    base_names: tuple[str, ...] = ()  # the other tensors' names, as names (read with the base ranges)
    # the store's other sparse block layouts (linear attention among full attention), by layout index
    others: tuple[tuple[int, "ExpertLayout"], ...] = ()

    def at(self, layout: int) -> "ExpertLayout":
        """The layout of the store's sparse blocks of layout index `layout` (phantom.files.store.layout_index)."""
        return dict(self.others).get(layout, self)

    @property
    def n_experts(self) -> int:
        return len(self.ranges)

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes (every expert has the same shapes)."""
        a, b = self.ranges[0]
        return b - a

    @property
    def base_bytes(self) -> int:
        return sum(b - a for a, b in self.base)

    def of(self, experts) -> list[tuple[int, int]]:
        """The byte ranges of `experts` (ids), merged."""
        return merge(self.ranges[e] for e in experts)

    @classmethod
    def of_store(cls, store, first: int | None = None) -> "ExpertLayout":
        """The layout of a phantom.files.store.BlockStore's MoE blocks, from its tensor specs, checked against
        the manifest's `files[blocks/NNN.safetensors].experts` where it records them.

        Raises:
            ValueError: not a mixture of experts, or a quantized store whose experts' codes and scales are not
                back to back (written before they were, or of a width that keeps the size order).
            StoreError: the manifest's ranges differ from the file's tensors."""
        cfg = store.cfg
        if not cfg.n_experts:
            raise ValueError("routed expert reads need a mixture-of-experts model; this one has no experts")
        kinds = {store.layout_index(i): i for i in reversed(range(cfg.n_layers)) if cfg.sparse(i)}
        others = () if first is not None else tuple((k, cls.of_store(store, i)) for k, i in sorted(kinds.items())
                                                    if i != min(kinds.values()))
        first = min(kinds.values()) if first is None else first  # dense layers among sparse ones read whole
        if store.quant is not None and not store.blocks[first].experts:
            raise ValueError("routed expert reads: this quantized store keeps each expert's codes and scales apart "
                             "(no expert ranges in its manifest); use expert_reads whole")
        ranges = [tuple(r) for r in expert_ranges(store.blocks[first].specs, cfg.n_experts)]
        recorded = [tuple(r) for r, _ in getattr(store.blocks[first], "experts", ())] or \
            [tuple(r) for r in store.manifest.get("files", {}).get(block_file(first), {}).get("experts", ranges)]
        if recorded != ranges:
            raise StoreError(f"{store.path}: the manifest's expert ranges differ from the block files' tensors; "
                             "re-create the store")
        names: list[list[str]] = [[] for _ in ranges]  # dense names: a quantized expert's are dequantized
        rest = []
        for name in store.dense_like(first):
            parts = name.split(".")
            if parts[:2] == ["feed_forward", "experts"]:
                names[int(parts[2])].append(name)
            else:
                rest.append(name)
        nbytes = store.blocks[first].nbytes
        return cls(tuple(ranges), tuple(between(ranges, nbytes)), tuple(tuple(n) for n in names), nbytes,
                   cfg.experts_per_token, tuple(rest), others)


def read_ranges(entry, buf: torch.Tensor, ranges, drop_cache: bool = False) -> int:
    """Bytes [a, b) of a block file's data section into buf[a:b] for each range (entry: the store's
    FileEntry; a linked file's ranges are found in its segments), each file's ranges read together
    (phantom.files.directio.readinto_pieces: one descriptor, O_DIRECT, several requests in flight): a
    step's experts are many small ranges, and one request at a time pays a device's latency for each.
    Returns the bytes read."""
    by_path: dict = {}
    for a, b in ranges:
        if not entry.segments:
            by_path.setdefault(entry.path, []).append((entry.data_start + a, a, b))
            continue
        pos = 0
        for path, offset, n in entry.segments:  # the part of [a, b) in each linked range
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                by_path.setdefault(path, []).append((offset + lo - pos, lo, hi))
            pos += n
    for path, pieces in by_path.items():
        readinto_pieces(path, pieces, buf, drop_cache)
    return sum(b - a for a, b in ranges)


@dataclass
class ExpertReads:
    """A run's choice between routed and whole reads of its MoE blocks, and what it measured to make it.

    mode "routed" / "whole" is fixed; "auto" reads whole blocks until the router's hits, the compute
    seconds of a block and the tier's seconds per byte are measured (the first step: it also checks
    each file's checksum), then, at each step's plan, routes the blocks where `block_seconds` says the
    routed read is faster for that step's tokens."""

    layout: ExpertLayout
    mode: str
    n_blocks: int
    round_trip_s: float = 1e-4
    sparse: tuple | None = None  # the blocks with experts (None: every block; dense ones among them read whole)
    counts: torch.Tensor = field(init=False)  # (n_blocks, E): tokens that picked each expert
    rows: torch.Tensor = field(init=False)  # (n_blocks,): tokens routed
    compute_s: float | None = None  # one block's forward over a step's tokens (exponential average)
    s_per_byte: float | None = None  # a load's, whole or the non-expert part
    request_s: float | None = None  # a routed expert read's cost a request beyond its bytes (None: round_trip_s)
    routed: frozenset = frozenset()  # the blocks read routed this step
    known: dict = field(default_factory=dict)  # this step's experts each block's tokens routed to
    bases_kept: bool = False  # the device keeps the blocks' other weights: a load reads experts alone

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"expert_reads must be one of {', '.join(MODES)}, not {self.mode!r}")
        self.counts = torch.zeros(self.n_blocks, self.layout.n_experts, dtype=torch.float64)
        self.rows = torch.zeros(self.n_blocks, dtype=torch.float64)

    @property
    def blocks(self):
        return range(self.n_blocks) if self.sparse is None else self.sparse

    def observe(self, block: int, chosen: torch.Tensor) -> None:
        """A block's routing of some tokens (chosen: (N, k) expert ids)."""
        self.counts[block] += torch.bincount(chosen.reshape(-1).cpu(), minlength=self.layout.n_experts).double()
        self.rows[block] += chosen.shape[0]

    def observe_times(self, compute_s: float | None = None, nbytes: int = 0, read_s: float = 0.0) -> None:
        avg = lambda old, new: new if old is None else 0.7 * old + 0.3 * new  # noqa: E731
        if compute_s is not None:
            self.compute_s = avg(self.compute_s, compute_s)
        if nbytes > (1 << 16) and read_s > 0:
            self.s_per_byte = avg(self.s_per_byte, read_s / nbytes)

    def observe_load(self, stats) -> None:
        """A load's bytes and seconds (phantom.stream.trace.LoadStats): the tier's seconds per byte."""
        self.observe_times(nbytes=stats.bytes_read + stats.bytes_ram, read_s=stats.read_s + stats.copy_s)

    def observe_fill(self, stats) -> None:
        """A routed read of experts after the router (LoadStats with its `requests`): what each of its
        requests cost beyond its bytes at the loads' rate (measured once a load has set that rate)."""
        if self.s_per_byte is None or not stats.requests:
            return
        spent = stats.read_s + stats.copy_s - (stats.bytes_read + stats.bytes_ram) * self.s_per_byte
        new = max(0.0, spent) / stats.requests
        self.request_s = new if self.request_s is None else 0.7 * self.request_s + 0.3 * new

    def remember(self, block: int, experts) -> None:
        """Experts some token of this step routes to in block: its next load this step reads them too
        (the backward's reload reads the experts the forward used)."""
        self.known[block] = self.known.get(block, frozenset()) | frozenset(int(e) for e in experts)

    def wanted(self, block: int, unchecked: bool) -> frozenset | None:
        """What a load of block reads: None, the whole block; else its non-expert bytes and the experts
        its tokens routed to this step (none before its router ran). A file not yet checked whose parts
        cannot be checked alone (`unchecked`: a store without per-expert records, verify "full") is read
        whole once: its checksum covers the whole data section."""
        if block not in self.routed or unchecked:
            return None
        return self.known.get(block, frozenset())

    def probs(self, block: int) -> torch.Tensor | None:
        return self.counts[block] / self.rows[block] if self.rows[block] > 0 else None

    def plan(self, tokens: int) -> frozenset:
        """The blocks to read routed in a step of `tokens` tokens (set as `routed`)."""
        if self.mode == "whole" or tokens <= 0:
            chosen = []
        elif self.mode == "routed":
            chosen = self.blocks
        elif self.compute_s is None or self.s_per_byte is None:
            chosen = []
        else:
            chosen = [i for i in self.blocks if self.pays(i, tokens)]
        self.routed, self.known = frozenset(chosen), {}
        return self.routed

    def pays(self, block: int, tokens: int) -> bool:
        lay = self.layout
        probs = self.probs(block)
        hits, runs = (f(probs, tokens, lay.n_experts, lay.k) for f in (expected_hits, expected_runs))
        request_s = self.round_trip_s if self.request_s is None else self.request_s
        base = 0 if self.bases_kept else lay.base_bytes
        whole, routed = block_seconds(self.compute_s, base, lay.expert_bytes, lay.n_experts, hits,
                                      self.s_per_byte, request_s, runs)
        return routed < whole
