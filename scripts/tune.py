"""Plan a run before it starts: `python scripts/tune.py --preset 70B --batch-size 4 --seq-len 1024`.

Measures this machine once per block shape (on a few synthetic blocks when the model has no weights
here: a preset, or a config.json / params.json), then prints the placement it would choose for the
whole model (blocks on the device / in RAM / on disk, prefetch, activations, micro-batch), the memory
it needs, the predicted step, tokens/s and what bounds it; or how much is missing when nothing fits.
The profile it saves is what `finetune.py --prefetch auto` reads. With --quantize nf4|int8 it plans the
model stored quantized (prepare_model.py --quantize), with --quantize fp8-block as an FP8 checkpoint ships it
(DeepSeek-V3, Kimi-K2, Qwen3-FP8: e4m3 weights and a float32 scale per 128x128 tile), int4-group as
Kimi-K2-Thinking ships its experts (compressed-tensors INT4, a bf16 scale per 32 values; the rest bf16), mxfp4 as
gpt-oss ships its experts, and prints the 16-bit store's plan beside it:

    python scripts/tune.py --preset 70B --quantize nf4 --host-memory 64G --device cpu
"""
import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
import torch  # noqa: E402
from phantom.arch import family, presets
from phantom.arch.quantformat import METHODS, SHIPPED  # noqa: E402
from phantom.files.store import BlockStore  # noqa: E402
from phantom.plan import costexperts, costfull, costsweep, gpusheets, optimtimer, planner, profiles, tune
from phantom.plan import costinputs as ci
from phantom.plan import costmodel as cm
from phantom.stream.adam8bit import OPTIMIZERS  # noqa: E402
from phantom.stream.memory import free_host_bytes  # noqa: E402
from phantom.stream.placement import Placement, offload_choices, parse_bytes  # noqa: E402
from phantom.train import cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help="a prepared store (folder, or preset name under weights/)")
    what.add_argument("--preset", default=None, help=f"plan a preset without its weights: {', '.join(presets.PRESETS)}")
    what.add_argument("--config", default=None, help="plan from a config.json (HF) or params.json (Meta) alone")
    a("--vocab-size", type=int, default=None, help="with a params.json that says -1: the tokenizer's vocabulary")
    a("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    a("--gpu", default=None, metavar="NAME", help="plan for this GPU without it: its rates derived from its "
      f"datasheet, not measured (the disk measured here); one of {', '.join(gpusheets.SHEETS)}")
    a("--dtype", default="auto", choices=cli.DTYPES, help="compute dtype (auto: bf16 on CUDA)")
    a("--store-dtype", default="bf16", choices=cli.STORE_DTYPES, help="the dtype a store would be prepared in")
    a("--quantize", default=None, choices=METHODS + SHIPPED + ("fp8-mxfp4",),
      help="plan the model stored quantized (prepare_model.py --quantize; fp8-block: an FP8 checkpoint as it "
           "ships, 128x128 tiles; int4-group, mxfp4: the routed experts as Kimi-K2-Thinking and gpt-oss ship "
           "them; fp8-mxfp4: FP8 tiles with the experts in MXFP4, as DeepSeek-V4 ships), beside its --store-dtype plan")
    a("--host-memory", type=parse_bytes, default=None, help="plan for a host with this much free memory, e.g. 64G "
                                                           "(default: what is free here)")
    a("--batch-size", type=int, default=4, help="rows per block call (finetune's --batch-size)")
    a("--grad-accum", type=int, default=1, help="calls per block per step (rows per step = batch size x this)")
    a("--seq-len", type=int, default=128, help="tokens per row")
    a("--mode", default="lora", choices=("lora", "full"), help="plan a LoRA run, or full finetuning (every weight: "
                                                              "the optimizer's state, the host memory and disk it "
                                                              "needs, the seconds it adds)")
    a("--optim", default="adamw_torch", choices=OPTIMIZERS, help="full finetuning's optimizer: fp32 moments, or "
                                                                "8-bit ones (a quarter of the state's bytes)")
    a("--adapters", type=int, default=1, metavar="K", help="plan K LoRA adapters trained in one run (finetune.py "
                                                          "--sweep): their predicted step against K separate runs, "
                                                          "and how many adapters fit beside the blocks")
    a("--offload", default="auto", choices=offload_choices(), help="offload mode to plan (auto: device, RAM, disk by "
                                                                  "budget; or a tier an installed package declares)")
    a("--device-budget", type=parse_bytes, default=None, help="device bytes for resident blocks and slots, e.g. 60G")
    a("--ram-budget", type=parse_bytes, default=None, help="host bytes for the RAM tier, e.g. 48G")
    a("--disk-budget", type=parse_bytes, default=None, help="disk space for the store (default: free space under "
                                                            "weights/; unchecked when the store exists)")
    a("--check", type=int, default=0, metavar="N", help="check the plan on N blocks of this shape (a synthetic store "
                                                        "under --check-dir), budgets at the plan's fractions: "
                                                        "measured step against predicted; exit 1 beyond 15%%")
    a("--check-dir", default=None, help="the N-block store (default weights/<name>-synthetic-<N>L; reused)")
    a("--steps", type=int, default=3, help="timed steps of the check, after one warm-up step")
    a("--json", action="store_true", help="print the plan as one JSON object")
    a("--table", type=int, default=0, help="also print the fastest N candidates")
    a("--quick", action="store_true", help="measure in about a minute: fewer repeats, a smaller read sample, a "
                                            "block's compute timed on a slice of it and scaled by FLOPs")
    a("--remeasure", action="store_true", help="measure again even if a profile is saved")
    a("--profile-dir", default=None, help="where profiles are saved (default $PHANTOM_CACHE/profiles or "
                                          "~/.cache/phantom/profiles)")
    return p.parse_args(argv)


def model_and_profile(args, device, dtype):
    """(name, ModelConfig, store dtype, quantization or None, profile, free disk bytes or None) for what the
    user named."""
    if args.preset or args.config:
        cfg = presets.preset(args.preset) if args.preset else read_config(Path(args.config), args.vocab_size)
        work = ci.Workload(args.batch_size, args.seq_len, dtype, args.store_dtype, args.quantize)
        profile = datasheet_profile(args, cfg, work) if args.gpu else \
            profiles.probe(cfg, device, work, args.profile_dir, args.quick, args.remeasure)
        disk = args.disk_budget if args.disk_budget is not None else profiles.free_disk_bytes(phantom.weights_dir())
        return args.preset or args.config, cfg, args.store_dtype, args.quantize, profile, disk
    store = BlockStore(phantom.resolve_model(args.model or "tiny"), verify="none")
    if args.quantize and profiles.store_quant(store) != args.quantize:
        raise ValueError(f"{store.path} is stored {profiles.store_quant(store) or store.manifest['dtype']}; --quantize "
                         f"plans a preset or config (prepare a {args.quantize} store to plan it)")
    if args.gpu:
        work = ci.Workload(args.batch_size, args.seq_len, dtype, store.manifest["dtype"], store.quant)
        profile = datasheet_profile(args, store.cfg, work, store)
    else:
        profile = profiles.profile_for(store, device, dtype, args.batch_size, args.seq_len, args.profile_dir,
                                       args.quick, args.remeasure)
    return str(store.path), store.cfg, store.manifest["dtype"], profiles.store_quant(store), profile, args.disk_budget


def datasheet_profile(args, cfg, work: ci.Workload, store: BlockStore | None = None):
    """--gpu: the card's profile from its datasheet (phantom.plan.gpusheets), with this machine's disk measured on
    the store's blocks, or on a few synthetic blocks of a slice of the shape where there is no store."""
    card = gpusheets.sheet(args.gpu)
    disk = profiles.disk_rates(store) if store is not None else \
        profiles.probe_disk(cfg, work.store_dtype, args.profile_dir)
    return gpusheets.derive(card, cfg, work, gpusheets.DiskRates(*disk), free_host_bytes())


def plan_device(args):
    """The device a plan is for: --gpu's (not here: a CUDA card by its datasheet), else --device resolved."""
    if args.gpu is None:
        return phantom.resolve_device(args.device)
    gpusheets.sheet(args.gpu)  # an unknown name: one line listing the known ones, before anything is measured
    if args.device not in ("auto", "cuda"):
        raise ValueError(f"--gpu plans a CUDA card: not with --device {args.device}")
    if args.check or args.mode == "full":
        raise ValueError("--gpu plans a card that is not here: --check and --mode full measure on it (run tune.py "
                         "on the GPU)")
    return torch.device("cuda")


def plan_dtype(args, device) -> str:
    """The compute dtype planned: --dtype resolved for the device; --gpu's datasheet rate is its 16-bit one."""
    dtype = cli.resolve_dtype(args.dtype, device)
    if args.gpu and dtype not in ("bf16", "fp16"):
        raise ValueError(f"--gpu plans from the datasheet's 16-bit tensor rate: --dtype bf16 or fp16, not {dtype}")
    return dtype


def beside_16bit(args, cfg, store_dtype: str, dtype: str, profile, budgets, rows: int, best) -> str:
    """The same model's plan with a 16-bit store on the same machine, and how the quantized one compares."""
    shape = ci.shape_of(cfg, store_dtype, dtype, args.seq_len)
    cands = planner.search(profile, shape, rows, search_space(args, budgets))
    fits = [c for c in cands if c.fits]
    if not fits:
        return f"{store_dtype} store: nothing fits ({min(cands, key=lambda c: c.missing_bytes).missing_text()})"
    other = planner.choose(fits)
    s = other.split
    return (f"{store_dtype} store ({cm.gib(shape.store_bytes)}): {s['device']} blocks on the device, {s['ram']} in "
            f"RAM, {s['disk']} on disk; {other.bytes_read / 1e9:.1f} GB read per step; predicted "
            f"{other.step_s:.3f} s/step against {best.step_s:.3f} s quantized ({other.step_s / best.step_s:.2f}x)")


def fp32_beside(args, device, profile_overrides: dict, budgets: Placement, rows: int, why: str, best) -> dict:
    """Where bf16 is emulated on this CPU: the same plan computing in fp32 (its profile measured as the
    bf16 one was, quick if that was), as {"bf16_emulated": why, "fp32_step_s": s or None, "line": text}."""
    name, cfg, store_dtype, quant, profile, _ = model_and_profile(args, device, "fp32")
    profile = dataclasses.replace(profile, **profile_overrides)
    cands = planner.search(profile, ci.shape_of(cfg, store_dtype, "fp32", args.seq_len, quant), rows,
                           search_space(args, budgets))
    fits = [c for c in cands if c.fits]
    other = planner.choose(fits) if fits else None
    beside = (f"fp32 predicted {other.step_s:.3f} s/step against {best.step_s:.3f} s in bf16 "
              f"({best.step_s / other.step_s:.1f}x slower in bf16)" if other is not None else
              f"fp32: nothing fits ({min(cands, key=lambda c: c.missing_bytes).missing_text()})")
    return {"bf16_emulated": why, "fp32_step_s": other.step_s if other is not None else None,
            "line": f"warning    bf16 is emulated on this CPU ({why}): {beside}; --dtype fp32 (what --dtype auto "
                    f"chooses on a CPU) computes in fp32"}


def search_space(args, budgets: Placement) -> planner.SearchSpace:
    """The candidates the flags allow: their offload mode and micro-batch, within the budgets."""
    recompute = ("all",) if args.mode == "full" else planner.SearchSpace.recompute  # full finetuning recomputes
    return planner.SearchSpace(offloads=(args.offload,), recompute=recompute, micro_batches=(args.batch_size,),
                               budgets=budgets)


def plan_full(args, device, cfg, profile, shape, best) -> costfull.FullPrediction:
    """--mode full: the optimizer's rates measured here (seconds), the full run of the chosen placement."""
    rates = optimtimer.measure(device, phantom.weights_dir())
    return costfull.predict_full(profile, shape, cfg, best, args.optim, rates)


def describe_adapters(args, cfg, profile, shape, best) -> str:
    """--adapters K: the plan's step for K adapters against K separate runs on its placement, and how many
    adapters (LoRA rank 8 on q, v each) fit beside its blocks."""
    state = costsweep.lora_params(cfg) * costsweep.LORA_STATE_BYTES
    rows = args.batch_size * args.grad_accum
    fit = costsweep.adapters_that_fit(profile, shape, best.placement, best.activations, rows, state)
    fits = f"; {fit} adapters of {rows} rows (LoRA rank 8 on q, v) fit beside these blocks"
    if args.adapters == 1:
        return f"adapters   one{fits} (--adapters K plans a sweep of K)"
    sweep = costsweep.predict_sweep(profile, shape, best.placement, best.activations, rows, args.adapters, state)
    return sweep.describe() + fits


def read_config(path: Path, vocab_size: int | None):
    if not path.is_file():
        raise FileNotFoundError(f"no config file at {path}: give a config.json (HF) or params.json (Meta)")
    return family.from_meta_params(path, vocab_size) if path.name == "params.json" else family.from_hf_config(path)


@dataclasses.dataclass(frozen=True)
class Subject:
    """What a plan is for: its name, its config and how its store is (or would be) stored."""

    name: str
    cfg: object
    store_dtype: str
    quant: str | None


def check(args, subject: Subject, dtype: str, device, profile, best) -> int:
    """Run the plan's fractions on N blocks of the shape; print the measured step beside the prediction."""
    name, cfg, store_dtype, quant = subject.name, subject.cfg, subject.store_dtype, subject.quant
    path = Path(args.check_dir or phantom.weights_dir() / f"{Path(name).stem}{'-' + quant if quant else ''}"
                f"-synthetic-{args.check}L")
    r = tune.check_plan(best, profile, cfg, ci.Workload(best.rows, args.seq_len, dtype, store_dtype, quant), device,
                        args.check, args.steps, path)
    if args.json:
        print(json.dumps({"model": name, "plan": best.to_dict(), "check": r}))
        return 0 if r["within_15"] else 1
    print(planner.describe_plan(best, ci.shape_of(cfg, store_dtype, dtype, args.seq_len, quant), profile, name))
    s = r["split"]
    print(f"check      {r['blocks']} blocks at {path}: {s['device']} on the device, {s['ram']} in RAM, {s['disk']} "
          f"on disk (the scheduler {'agrees' if r['tiers_match'] else 'chose otherwise: ' + str(r['tiers'])}); "
          f"read per step {r['bytes_read_predicted'] / 1e9:.1f} GB predicted, measured "
          f"{', '.join(f'{b / 1e9:.1f}' for b in r['bytes_read_measured'])}")
    steps = ", ".join(f"{t:.2f}" for t in r["steps_s"])
    print(f"           measured {r['measured_step_s']:.3f} s/step (steps {steps}),"
          f" predicted {r['predicted_step_s']:.3f} s: {r['error']:+.1%}, "
          f"{'within' if r['within_15'] else 'NOT within'} 15%")
    if "disk_gbps_around" in r:
        print(f"           disk {r['disk_gbps_profile']:.2f} GB/s in the profile, "
              f"{' and '.join(f'{g:.2f}' for g in r['disk_gbps_around'])} GB/s just before and after the steps: "
              f"with that rate, predicted {r['predicted_with_disk_now_s']:.3f} s ({r['error_with_disk_now']:+.1%})")
    return 0 if r["within_15"] else 1


def check_flags(args) -> None:
    if min(args.batch_size, args.grad_accum, args.seq_len, args.adapters) < 1:
        raise ValueError("--batch-size, --grad-accum, --seq-len and --adapters must be >= 1")
    if args.mode == "full" and (args.quantize or args.adapters > 1):
        raise ValueError("--mode full trains every 16-bit weight of one model: it plans without --quantize and "
                         "--adapters")


def run(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    try:
        check_flags(args)
        device = plan_device(args)
        dtype = plan_dtype(args, device)
        name, cfg, store_dtype, quant, profile, disk = model_and_profile(args, device, dtype)
        overrides = dict(free_disk_bytes=disk, **({} if args.host_memory is None else
                                                  {"free_host_bytes": args.host_memory}))
        profile = dataclasses.replace(profile, **overrides)
        budgets = Placement(device_budget=args.device_budget, ram_budget=args.ram_budget)
        rows = args.batch_size * args.grad_accum * args.adapters  # K adapters: K times the rows, one read
        shape = ci.shape_of(cfg, store_dtype, dtype, args.seq_len, quant)
        cands = planner.search(profile, shape, rows, search_space(args, budgets))
        best = planner.choose(cands)
        emulated = None  # bf16 emulated here: the fp32 plan beside it
        if (why := cli.emulated_bf16(dtype, device)) is not None:
            emulated = fp32_beside(args, device, overrides, budgets, rows, why, best)
        if args.check:
            return check(args, Subject(name, cfg, store_dtype, quant), dtype, device, profile, best)
        full = plan_full(args, device, cfg, profile, shape, best) if args.mode == "full" else None
    except (OSError, ValueError) as e:  # nothing fits, bad flags, a bad config file; a bug keeps its traceback
        line = cli.user_error(e)
        if line is None:
            print(cli.BUG, file=sys.stderr)
            raise
        if args.json and str(e).startswith("no placement fits"):
            least = min(cands, key=lambda c: c.missing_bytes)
            print(json.dumps({"model": name, "fits": False, "missing": dict(least.missing), "error": str(e)}))
        print(f"error: {' '.join(line.split())}", file=sys.stderr)
        return 2
    if args.json:
        extra = {k: v for k, v in (emulated or {}).items() if k != "line"}
        if full is not None:
            extra["full"] = {**dataclasses.asdict(full), "step_s": full.step_s, "fits": full.fits}
        print(json.dumps({"model": name, "profile": profile.to_dict(), **best.to_dict(), **extra}))
        return 0
    print(planner.describe_plan(best, shape, profile, name))
    if args.gpu:
        print(gpusheets.describe_derivation(gpusheets.sheet(args.gpu), profile))
    if args.seq_len > cfg.max_seq_len:
        print(f"warning    rows of {args.seq_len} tokens are longer than the model's context ({cfg.max_seq_len}): "
              f"planned as they would run; finetune.py refuses them unless the config's max_seq_len allows them")
    if full is not None:
        print(full.describe())
    else:
        print(describe_adapters(args, cfg, profile, shape, best))
    if emulated is not None:
        print(emulated["line"])
    if cfg.n_experts and not quant:
        print(costexperts.describe_expert_reads(profile, shape, cfg, store_dtype, best))
    if args.quantize:
        print(beside_16bit(args, cfg, store_dtype, dtype, profile, budgets, rows, best))
    if (more := planner.faster_if_more_memory(cands, best)) is not None:
        print(f"more memory: {more.describe()} would take {more.step_s:.3f} s/step (needs {more.missing_text()})")
    if args.table:
        print("\n" + tune.format_table(cands, args.table, best))
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)  # a broken tier plugin, found while building the flags: one line, exit 2


if __name__ == "__main__":
    sys.exit(main())
