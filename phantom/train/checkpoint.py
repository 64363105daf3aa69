"""Checkpoints of a run: what a run is (its identity, checked on --resume), saving and loading one
(a folder replaced whole through phantom.base.fileio, RNG states included, so a resumed run ends where an
uninterrupted one would), the disk space a run will need, the one line for a failed read or write,
and full finetuning's working folder (the store copy and optimizer state a run rewrites).

A checkpoint is sealed (phantom.files.seal): its files' sha256 and the run's id (phantom.files.runfolder's marker)
in checkpoint/manifest.json, written last. --resume checks the seal before reading anything else, so a
file copied in from another run, a damaged one, or another run's checkpoint is refused naming it; a
checkpoint without a seal (an older phantom's) is refused with a line saying to start again.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from phantom.base import fileio, safejson
from phantom.files import runfolder, seal
from phantom.files.tensorfile import write_safetensors
from phantom.files.workingcopy import link_tree
from phantom.stream.adam8bit import BLOCK

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"
# A resumed run must match these, or it could not end where an uninterrupted one would.
RUN_KEYS = ("model", "lora", "dtype", "mode", "optim", "data", "seq_len", "batch_size", "grad_accum", "seed",
            "shuffle")
OLD_DEFAULTS = {"optim": "adamw_torch"}  # what a checkpoint written before a key existed ran with
ACTIVATION_KEYS = ("recompute", "compile", "checkpoint_inner", "mlp_chunk")  # a checkpoint without one: the run's


def run_identity(model, train_data, cfg) -> dict:
    """What a checkpoint must share with the run that resumes it (train_data: a phantom.data.dataset.TokenData
    or preference pairs; cfg: the run's phantom.train.trainconfig.TrainConfig)."""
    lora = getattr(model, "lora_cfg", None)
    ident = {"model": dataclasses.asdict(model.cfg), "lora": dataclasses.asdict(lora) if lora else None,
             "dtype": str(model.dtype), "mode": cfg.mode, "data": f"{train_data.key}:{len(train_data)}",
             **{k: getattr(cfg, k) for k in ("optim", "seq_len", "batch_size", "grad_accum", "seed", "shuffle")},
             "activations": recorded_activations(model), "weights": weights_fingerprint(model, cfg.mode),
             "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("resume", "progress", "check_step")}}
    return json.loads(json.dumps(ident))  # as meta.json will read back (tuples become lists)


def weights_fingerprint(model, mode: str) -> str | None:
    """Which base weights a LoRA (or DPO) run trains on: a sha256 over the store manifest's per-file sha256s
    (a store converted again in another layout differs too). None for full finetuning, whose resume
    restores the weights themselves from the checkpoint."""
    store = getattr(model, "store", None)
    if mode not in ("lora", "dpo") or store is None:
        return None
    return store_fingerprint(store)


def store_fingerprint(store) -> str:
    """sha256 over a store manifest's per-file sha256s: which weights these are."""
    files = {**store.manifest.get("files", {}), **store.manifest.get("links", {}).get("files", {})}
    listing = sorted((rel, str(info.get("sha256", ""))) for rel, info in files.items())
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def recorded_activations(model) -> dict | None:
    """The choices that can change a run's last bits (compile, recompute) as the model resolved them;
    a checkpoint records them so --resume reuses them unless a flag says otherwise."""
    acts = getattr(model, "activations", None)
    return None if acts is None else {k: getattr(acts, k) for k in ACTIVATION_KEYS}


def checkpoint_activations(out: Path) -> dict:
    """What the checkpoint in `out` recorded of recorded_activations ({} if none)."""
    ckpt = find_checkpoint(Path(out))
    if ckpt is None:
        return {}
    try:
        return safejson.load(ckpt / "meta.json", finite=False).get("activations") or {}
    except (OSError, ValueError):
        return {}  # load_checkpoint reports a damaged checkpoint


def resume_point(out: Path, activations, flags: dict):
    """Before a --resume run loads anything (the working store of a killed run included): the
    activations as out's checkpoint recorded them, except those a flag sets (`flags[name]` not None),
    and the first step the run trains (one past the checkpoint's).

    Raises:
        FileNotFoundError: out holds no checkpoint.
    """
    ckpt = find_checkpoint(Path(out))
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {Path(out) / CHECKPOINT}; run without --resume to start")
    check_sealed(ckpt, Path(out))
    recorded = checkpoint_activations(out)
    activations = dataclasses.replace(activations, **{k: recorded[k] for k in ACTIVATION_KEYS
                                                      if k in recorded and flags.get(k) is None})
    return activations, int(safejson.load(ckpt / "meta.json", finite=False)["step"]) + 1


def tracker_runs(out: Path) -> dict[str, str]:
    """{tracker: run id} the checkpoint in out kept (wandb, MLflow; {} for none): --resume continues them."""
    ckpt = find_checkpoint(Path(out))
    runs = safejson.load(ckpt / "meta.json", finite=False).get("trackers") if ckpt is not None else None
    return {k: v for k, v in runs.items() if isinstance(v, str)} if isinstance(runs, dict) else {}


def rng_states() -> dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "python": random.getstate()}


def set_rng_states(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    kind, key, *rest = s["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), *rest))
    random.setstate(s["python"])


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(out: Path, model, opt, sched, step: int, identity: dict, extra: dict) -> Path:
    """Write out/checkpoint atomically: a complete new folder replaces the old one in one rename.

    Holds the PEFT adapter, the raw fp32 trainable tensors (for an exact resume), the optimizer and
    LR-scheduler states, the RNG states and the data position (the step).
    """
    final, tmp = out / CHECKPOINT, out / f"{CHECKPOINT}.tmp"
    try:  # a crash between the swap's two renames leaves checkpoint.old, which find_checkpoint takes
        with fileio.replacing_folder(final, tmp, crash_point="checkpoint.rename"):
            _write_checkpoint(tmp, model, opt, sched, step, identity, extra)
            seal.write_seal(tmp, runfolder.run_id(out), step=step)  # last: lists every file above
    except OSError as e:  # disk full: the previous checkpoint stays; no half-written folder is left
        raise e if e.filename else OSError(e.errno, e.strerror, str(tmp)) from None
    return final


def _write_checkpoint(tmp: Path, model, opt, sched, step: int, identity: dict, extra: dict) -> None:
    if getattr(model, "lora_cfg", None) is not None:
        model.save_adapter(tmp / "adapter")
    if getattr(model, "full", False) and model.scheduler is not None:
        # streamed full finetuning: the working store and the block optimizer's state, as hard
        # links (a snapshot that costs no copy: their files are only ever replaced by rename)
        model.save_full()
        link_tree(model.store.path, tmp / "store")
        link_tree(model.block_optimizer.state_dir, tmp / "optim")
    write_safetensors(tmp / "trainable.safetensors", trainable_state(model))
    state = {"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_states(),
             "data_position": step, "extra": extra}
    buf = io.BytesIO()
    torch.save(state, buf)
    fileio.atomic_write(tmp / "state.pt", buf.getvalue())
    # the placement is recorded, not checked: tiers and prefetch never change the numbers (tests/test_tiers.py)
    placement = getattr(model, "placement", None)
    fileio.atomic_write_json(tmp / "meta.json", {"step": step, "time": time.time(), **identity,
                                                 "placement": dataclasses.asdict(placement) if placement else None,
                                                 "trackers": extra.get("trackers") or {}})
    fileio.fsync_dir(tmp)


def restore_full_snapshot(out: Path, work_dir: Path) -> bool:
    """Before a streamed full-finetune model is loaded with --resume: put the checkpoint's store and
    optimizer state back into work_dir, rolling back whatever a crashed step wrote after it."""
    ckpt = find_checkpoint(Path(out))
    if ckpt is None or not (ckpt / "store" / "manifest.json").is_file():
        return False
    link_tree(ckpt / "store", Path(work_dir) / "store")
    link_tree(ckpt / "optim", Path(work_dir) / "optim")
    return True


def prepare_work_dir(out: Path, work_dir: Path, restore: bool, base: Path) -> None:
    """Full finetuning's working folder (work_dir/store, work_dir/optim), before the model opens it: with
    `restore` (a streamed --resume) the checkpoint's store and optimizer state put back, rolling back
    whatever a crashed step wrote after it; otherwise a previous run's working copy is removed, so
    the run starts from the base model (`base`), which phantom.load clones again."""
    work_dir = Path(work_dir)
    if restore:
        restore_full_snapshot(Path(out), work_dir)
    elif (work_dir / "store").exists():
        if not runfolder.made_work_folders(out):
            raise runfolder.RunFolderError(f"{work_dir / 'store'} was not written by a full finetune run of phantom; "
                                           f"move it away or choose another --out")
        log.warning("%s holds a previous run's weights; starting again from %s", work_dir / "store", base)
        for sub in ("store", "optim"):
            shutil.rmtree(work_dir / sub, ignore_errors=True)


def find_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (a crash between the two renames leaves checkpoint.old)."""
    for p in (out / CHECKPOINT, out / f"{CHECKPOINT}.old"):
        if (p / "meta.json").is_file() and (p / "state.pt").is_file():
            return p
    return None


def io_error_line(e: OSError, out: Path, store: Path | None = None) -> str | None:
    """The one line for a failed read or write the user can fix: what failed, on which file (and
    store), and the way on from the last checkpoint. None: not the user's to fix (a bug).

    'no space left on device writing out/checkpoint.tmp/state.pt; the last checkpoint (step 20) is
    intact: free space and rerun with --resume'
    """
    name = Path(e.filename).resolve() if e.filename else None
    inside = lambda root: root is not None and name is not None and Path(root).resolve() in name.parents  # noqa: E731
    writing = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or inside(out)
    line = fileio.describe(e, "writing" if writing else "reading")
    if line is None:
        return None
    if inside(store) and not inside(out):
        line += f" (a file of the store {store})"
    fix = {errno.ENOSPC: "free space", errno.EDQUOT: "free space or raise the quota",
           errno.EIO: "check the disk (dmesg) or copy the files elsewhere"}.get(e.errno, "make it writable or "
                                                                                     "choose another --out")
    ckpt = find_checkpoint(Path(out))
    if ckpt is None:
        return f"{line}; no checkpoint was written yet: {fix} and run again"
    step = safejson.load(ckpt / "meta.json", finite=False).get("step")
    return f"{line}; the last checkpoint (step {step}) is intact: {fix} and rerun with --resume"


def check_sealed(ckpt: Path, out: Path) -> None:
    """The checkpoint is the one this run wrote, file for file (seal.SealError, one line, otherwise)."""
    try:
        seal.check_seal(ckpt, runfolder.run_id(out))
    except seal.SealError as e:
        raise seal.SealError(f"--resume: {e}") from None


def read_state(path: Path) -> dict:
    """state.pt, tensors and plain values only (weights_only): anything else is one line naming it."""
    try:
        state = torch.load(path, weights_only=True)
    except OSError:
        raise
    except Exception as e:  # truncated, not a torch file, or a pickle of other objects  # noqa: BLE001
        raise seal.SealError(f"--resume: {path} is not a checkpoint state phantom wrote ({type(e).__name__}); "
                             f"start the run again in a new --out") from None
    if not isinstance(state, dict) or not {"step", "optimizer", "scheduler", "rng"} <= state.keys():
        raise seal.SealError(f"--resume: {path} is not a checkpoint state phantom wrote (its keys differ)")
    return state


def check_optimizer_shapes(opt) -> None:
    """Each parameter's optimizer state has its shape (load_state_dict takes any: a moment of another
    LoRA rank would fail only at the next step)."""
    for group in opt.param_groups:
        for p in group["params"]:
            for key, v in opt.state.get(p, {}).items():
                want = (-(-p.numel() // BLOCK),) if key.endswith("_scale") else p.shape  # 8-bit: a scale a block
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != want:
                    raise ValueError(f"its {key} has shape {tuple(v.shape)} for a parameter of {tuple(p.shape)}")


def load_checkpoint(path: Path, model, opt, sched, identity: dict) -> dict:
    """Restore weights, optimizer, schedule and RNGs from `path`; returns its state (step, extra)."""
    meta = safejson.load(path / "meta.json", finite=False)
    diff = [k for k in RUN_KEYS if meta.get(k, OLD_DEFAULTS.get(k)) != identity[k]]
    if "optim" in diff:  # its moments are the other optimizer's: they cannot be read as these
        raise ValueError(f"--resume: the checkpoint in {path} holds {meta.get('optim', 'adamw_torch')}'s optimizer "
                         f"state, this run asks {identity['optim']}: resume with --optim "
                         f"{meta.get('optim', 'adamw_torch')}, or use another --out")
    if diff:
        k = diff[0]
        raise ValueError(f"--resume: the checkpoint in {path} comes from a different run ({k}: {meta.get(k)} "
                         f"here {identity[k]}); use the same model, data and batch settings, or another --out")
    if meta.get("weights") and identity.get("weights") and meta["weights"] != identity["weights"]:
        raise ValueError(f"--resume: the checkpoint in {path} was trained on other weights than "
                         f"{getattr(model.store, 'path', 'this model')} (its files differ: another checkpoint, or "
                         f"converted again); use the same model, or another --out")
    changed = [k for k, v in identity["config"].items() if meta["config"].get(k) != v and k not in RUN_KEYS]
    changed += [k for k, v in (identity.get("activations") or {}).items()
                if k in (meta.get("activations") or {}) and meta["activations"][k] != v]
    if changed:
        log.warning("resuming with changed settings %s: the run will differ from one that never stopped", changed)
    try:
        tensors = load_file(str(path / "trainable.safetensors"))
    except OSError:
        raise
    except Exception as e:  # safetensors' own error for a damaged file  # noqa: BLE001
        raise seal.SealError(f"--resume: {path / 'trainable.safetensors'} is damaged ({e})") from None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != set(params) or any(tensors[n].shape != p.shape for n, p in params.items()):
        raise ValueError(f"--resume: {path / 'trainable.safetensors'} holds other trainable tensors than the model")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
    state = read_state(path / "state.pt")
    try:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"])
        check_optimizer_shapes(opt)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise seal.SealError(f"--resume: {path / 'state.pt'} does not fit this run's optimizer ({e})") from None
    return state


METRICS_BYTES_PER_STEP = 600  # one metrics.jsonl record, with room for a sample now and then


def planned_bytes(model, cfg) -> dict[str, int]:
    """What the run will hold in cfg.out at its peak, by kind (bytes).

    A checkpoint replaces the previous one only when complete, so two exist for a moment; a full
    finetune rewrites every file of its working store while the checkpoint's snapshot keeps the
    previous version (two stores, whether the base could be hard-linked or not), and its AdamW state
    (fp32 master + two moments: 12 bytes per parameter) is held the same way.
    """
    trainable = sum(p.numel() for p in model.trainable_parameters())
    plan = {"metrics": METRICS_BYTES_PER_STEP * (cfg.iters + 1), "adapter": 4 * trainable,
            "checkpoints": 2 * 4 * 4 * trainable}  # fp32 weights + 2 moments + the adapter, twice
    store = getattr(model, "store", None)
    if getattr(model, "full", False) and getattr(model, "scheduler", None) is not None and store is not None:
        files = [store.embed, store.head, *store.blocks]
        plan["working store"] = 2 * sum(e.nbytes for e in files)
        n_block_params = sum(e.nbytes for e in store.blocks) // store.dtype.itemsize
        plan["optimizer state"] = 2 * 12 * n_block_params
    return plan


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_free_space(out: Path, plan: dict[str, int]) -> None:
    """Refuse, before any work, a run that cannot fit in cfg.out's filesystem; warn under a 10% margin."""
    need, free = sum(plan.values()), free_bytes(out)
    parts = ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in plan.items() if v)
    if need > free:
        raise ValueError(f"{out} has {free / 1e6:,.1f} MB free but this run will write about {need / 1e6:,.1f} MB "
                         f"({parts}); free space or choose an --out on a larger disk")
    if need > 0.9 * free:
        log.warning("%s: this run will write about %.1f MB of the %.1f MB free (%s); a full disk stops it "
                    "(resume with --resume)", out, need / 1e6, free / 1e6, parts)


def restore(out: Path, model, opt, sched, identity: dict, resume: bool) -> tuple[int, float]:
    """(start step, best eval loss) of the run: from out/checkpoint when resuming, else (0, inf)."""
    if not resume:
        if find_checkpoint(out):
            log.warning("%s holds a checkpoint that this run will replace; pass --resume to continue it", out)
        return 0, float("inf")
    ckpt = find_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / CHECKPOINT}; run without --resume to start")
    check_sealed(ckpt, out)
    state = load_checkpoint(ckpt, model, opt, sched, identity)
    log.info("resumed from %s at step %d", ckpt, state["step"])
    return state["step"], state["extra"].get("best_val", float("inf"))
