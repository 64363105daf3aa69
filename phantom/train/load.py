"""Opening a prepared model for a custom loop: `phantom.load` and the paths it resolves (presets,
store folders, Hub ids in the local cache), the device asked for."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from phantom.arch.presets import PRESETS
from phantom.files.store import BlockStore
from phantom.files.tensorfile import parse_dtype
from phantom.files.workingcopy import clone_store
from phantom.model import fullmode; from phantom.convert import hub
from phantom.model.lora import LoraConfig
from phantom.model.phantom_model import MODES, PhantomModel
from phantom.stream.optim import AdamWConfig
from phantom.stream.placement import Activations, Placement, split_knobs


def weights_dir() -> Path:
    """Where presets are prepared: $PHANTOM_WEIGHTS, else the checkout's weights/, else ./weights."""
    if env := os.environ.get("PHANTOM_WEIGHTS"):
        return Path(env)
    repo = Path(__file__).resolve().parent.parent.parent / "weights"
    return repo if repo.is_dir() else Path.cwd() / "weights"


def resolve_model(model: str | Path, revision: str = "main") -> Path:
    """A store path from a path, a preset name (generates `tiny` on first use) or a Hugging Face hub id
    found in the local hub cache (converted on first use, linked: phantom.convert.hub)."""
    path = Path(model)
    if path.is_dir():
        return path
    name = str(model)
    if name in PRESETS:
        path = weights_dir() / name
        if name == "tiny":
            from phantom.convert.synthetic import ensure_tiny
            return ensure_tiny(path)
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(
                f"model {name} is not prepared at {path}; run python scripts/prepare_model.py --src "
                f"CHECKPOINT_DIR --out {path} (or --synthetic --preset {name} for random weights)")
        return path
    if hub.is_hub_id(name):
        return hub.ensure_store(name, weights_dir(), revision)
    if os.sep in name or name.startswith("."):
        raise FileNotFoundError(f"no phantom store at {name}")
    raise ValueError(f"unknown model {name!r}: not a folder and not a preset ({', '.join(PRESETS)})")


def load(model: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
         placement: Placement = Placement(), activations: Activations = Activations(),
         lora: LoraConfig | None = LoraConfig(), mode: str = "lora", optim: AdamWConfig | None = None,
         work_dir: str | Path | None = None, verify: str = "fast", trace: bool = False, **knobs) -> PhantomModel:
    """Open a prepared model as a PhantomModel.

    Args:
        model: a preset name (resolved under weights_dir()) or a store folder.
        device: "cpu", "cuda", "cuda:1", "mps" or "auto" (the best available).
        dtype: compute dtype, "fp32", "bf16", "fp16" or a torch dtype.
        placement: where blocks live and how they stream (phantom.Placement: offload tiers by budget,
            prefetch depth, resident blocks). The default fills the device, then RAM, then disk.
        activations: what blocks keep for backward and how they run (phantom.Activations: recompute
            policy, inner checkpointing, micro-batch, compile).
        lora: the LoRA to train, or None.
        mode: "lora" (lora is trained) or "full" (every weight; lora is ignored).
        optim: the block optimizer for streamed full finetuning (lr, betas, weight decay, clipping).
        work_dir: streamed full finetuning writes updated blocks and optimizer state here: the
            store is cloned into work_dir/store on first use (hard links, so no second copy until
            a block changes) and reopened from there to resume; the original is never modified.
        verify: store integrity checks, "fast", "full" or "none" (see BlockStore).
        trace: record a Chrome trace of the scheduler's work.
        **knobs: any field of Placement or Activations by name (`offload="disk", prefetch=1,
            recompute="none"`), applied over `placement` and `activations`. `prefetch="auto"` takes
            the tuner's tiers, prefetch and resident blocks (as `finetune.py --prefetch auto`), planned
            for `batch_size` rows (default 1) of `seq_len` tokens (default min(1024, the model's
            max_seq_len)) per step: a saved profile of this machine, or a quick one measured now.

    Raises:
        FileNotFoundError: the model is not prepared. ValueError: a bad argument. StoreError: a corrupt store.
    """
    workload = None  # prefetch="auto": the rows and tokens per step the tuner plans for
    if knobs.get("prefetch") == "auto":
        knobs.pop("prefetch")
        workload = (knobs.pop("batch_size", 1), knobs.pop("seq_len", None))
    try:
        placement, activations = split_knobs(knobs, placement, activations)
    except TypeError as e:
        raise ValueError(f"phantom.load: {e}") from None
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    path = resolve_model(model)
    if mode == "full":
        lora, optim = None, optim or AdamWConfig()
        path = working_copy(path, placement, work_dir)
    else:
        optim = None
    store = BlockStore(path, verify=verify)
    device, dtype = resolve_device(device), parse_dtype(dtype)
    if workload is not None:
        from phantom.plan import tune
        rows, seq_len = workload
        best, placement = tune.resolve_prefetch("auto", path, device, dtype, placement, rows,
                                                seq_len or min(1024, store.cfg.max_seq_len))
        activations = tune.tuned_chunk(best, activations, "mlp_chunk" in knobs or
                                       activations.mlp_chunk != Activations.mlp_chunk)
    return PhantomModel(store, device, dtype, placement, activations, lora, optim, trace)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu or auto")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps was asked for but MPS is not available; use --device cpu or auto")
    return device


def working_copy(path: Path, placement: Placement, work_dir: str | Path | None) -> Path:
    """The store full finetuning trains: the original when resident; streamed, a working copy under
    work_dir (hard links, made on first use) that the blocks are rewritten into, optimizer state beside it."""
    fullmode.refuse_frozen(BlockStore(path, verify="none"))  # before a working copy is made
    if placement.offload == "none":
        return path
    if work_dir is None:
        raise ValueError("streamed full finetuning rewrites the weights: pass work_dir (--out)")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if not (work_dir / "store" / "manifest.json").is_file():
        clone_store(path, work_dir / "store")
    return work_dir / "store"
