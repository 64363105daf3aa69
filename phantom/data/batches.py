"""Rows and batches: token data cut into windows of seq_len + 1 tokens (plain text) or examples packed
into rows with segment ids (records), and the endless, resumable DataLoader whose batches are a pure
function of (seed, step).
"""
from __future__ import annotations

import logging
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from phantom.data.dataset import IGNORE_INDEX, TokenData

log = logging.getLogger(__name__)


class Windows(Dataset):
    """Plain text as windows of seq_len + 1 tokens; item i is the window starting at token i.

    Random windows sample any start; sequential ones step by seq_len (see BatchSampler).
    """

    def __init__(self, data: TokenData, seq_len: int, name: str = "data"):
        if len(data) < seq_len + 1:
            raise ValueError(f"the {name} ({len(data)} tokens) is shorter than one sequence of {seq_len} + 1 "
                             f"tokens; use a smaller --seq-len or more data")
        self.data, self.seq_len = data, seq_len
        self.n = len(data) - seq_len  # possible starts
        self.n_sequential = (len(data) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = np.asarray(self.data.tokens[i:i + self.seq_len + 1], dtype=np.int64)
        y = np.asarray(self.data.labels[i + 1:i + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(w[:-1]), torch.from_numpy(y)


class Packed(Dataset):
    """Examples packed greedily, in order, into rows of seq_len + 1 tokens, padded with -100 targets.

    An example longer than a row is truncated. With `segments`, items are (x, y, segment ids): the
    model then keeps the examples of a row apart (a block-diagonal causal mask, positions from 0 for
    each; see phantom.arch.layers.packed_layout). Without, the examples of a row attend to each other; either
    way the target of an example's first token is masked, so no loss crosses an example boundary.
    """

    def __init__(self, data: TokenData, seq_len: int, pad_id: int = 0, segments: bool = False):
        self.data, self.seq_len, self.pad_id, self.segments = data, seq_len, pad_id, segments
        ends = np.append(data.starts[1:], len(data))
        self.rows: list[list[tuple[int, int]]] = [[]]
        used, truncated = 0, 0
        for s, e in zip(data.starts.tolist(), ends.tolist()):
            n = min(e - s, seq_len + 1)
            truncated += n < e - s
            if used + n > seq_len + 1:
                self.rows.append([])
                used = 0
            self.rows[-1].append((s, n))
            used += n
        if truncated:
            log.warning("%d of %d examples are longer than --seq-len %d + 1 and were truncated",
                        truncated, len(data.starts), seq_len)
        self.n = self.n_sequential = len(self.rows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        toks = np.full(self.seq_len + 1, self.pad_id, np.int64)
        labs = np.full(self.seq_len + 1, IGNORE_INDEX, np.int64)
        segs = np.full(self.seq_len + 1, len(self.rows[i]), np.int64)  # the padding is a segment of its own
        at = 0
        for k, (s, n) in enumerate(self.rows[i]):
            toks[at:at + n] = self.data.tokens[s:s + n]
            labs[at:at + n] = self.data.labels[s:s + n]
            segs[at:at + n] = k
            at += n
        x, y = torch.from_numpy(toks[:-1]), torch.from_numpy(labs[1:])
        return (x, y, torch.from_numpy(segs[:-1])) if self.segments else (x, y)


def rows(data: TokenData, seq_len: int, pad_id: int = 0, name: str = "data", segments: bool = False
         ) -> Windows | Packed:
    """Plain text as windows, instruction data as packed rows (`name` is for error messages; `segments`:
    packed rows come with their segment ids, see Packed)."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    return Windows(data, seq_len, name) if data.fmt in ("text", "tokens") else Packed(data, seq_len, pad_id, segments)


# -- batches -------------------------------------------------------------------------------------

class BatchSampler(torch.utils.data.Sampler):
    """Row indices of each step's batch, a pure function of (seed, step): resuming needs only the step.

    Args:
        ds: Windows or Packed.
        batch: rows per batch.
        seed: seeds a torch.Generator per step (random windows) or per epoch (shuffled rows).
        shuffle: random windows / a new permutation of rows each epoch; False: in order, cycling.
        start: the first step to yield (the data position of a resumed run).
    """

    def __init__(self, ds: Windows | Packed, batch: int, seed: int = 0, shuffle: bool = True, start: int = 0):
        self.ds, self.batch, self.seed, self.shuffle, self.position = ds, batch, seed, shuffle, start
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int) -> list[int]:
        if self.shuffle and isinstance(self.ds, Windows):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            return torch.randint(self.ds.n, (self.batch,), generator=g).tolist()
        n = self.ds.n_sequential
        out = []
        for r in range(step * self.batch, (step + 1) * self.batch):
            epoch, k = divmod(r, n)
            out.append(self.order(epoch)[k] * (self.ds.seq_len if isinstance(self.ds, Windows) else 1))
        return out

    def order(self, epoch: int) -> list[int] | range:
        if not self.shuffle:
            return range(self.ds.n_sequential)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.ds.n_sequential, generator=g).tolist())
        return self._perm[1]

    def __iter__(self):
        step = self.position
        while True:
            yield self.indices(step)
            step += 1

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "shuffle": self.shuffle}


def _worker_init(_):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training thread's to handle


def loader(ds: Windows | Packed, batch: int, seed: int = 0, shuffle: bool = True, start: int = 0,
           workers: int = 1, pin_memory: bool = False, prefetch: int = 4) -> DataLoader:
    """An endless DataLoader of (x, y) batches (batch, seq_len) from step `start` on.

    Args:
        workers: processes preparing batches ahead (0: in the training thread).
        pin_memory: page-locked batches for asynchronous host-to-device copies (CUDA).
        prefetch: batches each worker keeps ready.
    """
    sampler = BatchSampler(ds, batch, seed, shuffle, start)
    return DataLoader(ds, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch if workers else None, worker_init_fn=_worker_init if workers else None,
                      generator=torch.Generator().manual_seed(seed))
