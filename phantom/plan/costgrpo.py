"""The cost model of a GRPO step (phantom.train.grpoloop), as pure functions: its three parts one after another,

    generation   batched generation of the step's N = prompts x G completions (phantom.plan.costgen): a prefill
                 of the prompts and a decode step per new token, each a read of every streamed block
    reference    the passes without autograd before the first update of a batch of rollouts: the old policy's
                 log-probabilities where a batch serves several steps, the initial adapter's where it is the
                 reference; a forward over the N rows each (phantom.plan.costmodel's forward of a training step)
    training     a LoRA step over the N rows of prompt + completion tokens (phantom.plan.costmodel.predict), with a
                 forward of the reference beside it in each loaded block where the base model is the reference

and the bytes read: the generation's loads, the reference passes' and the training step's.
"""
from __future__ import annotations

from dataclasses import dataclass

from phantom.arch.config import ModelConfig
from phantom.plan import costmodel
from phantom.plan.costgen import GenRates, predict_generation
from phantom.plan.costinputs import LoadTimes, MachineProfile, shape_of
from phantom.stream.placement import Activations, Placement, cycle_loads


@dataclass(frozen=True)
class GrpoStep:
    """A GRPO step's seconds by part and in all, and the bytes it reads from disk."""
    generation_s: float
    reference_s: float
    train_s: float
    bytes_read: int

    @property
    def step_s(self) -> float:
        return self.generation_s + self.reference_s + self.train_s


@dataclass(frozen=True)
class GrpoWork:
    """What a step runs: prompts x num_generations completions of completion_len tokens after prompts of
    prompt_len; reference_passes passes without autograd a batch of rollouts (0, 1 or 2, once per num_iterations
    steps), a base-model reference beside the training pass or not."""
    prompts: int
    num_generations: int
    prompt_len: int
    completion_len: int
    num_iterations: int = 1
    reference_passes: int = 0
    base_reference: bool = False


def predict_grpo_step(rates: GenRates, profile: MachineProfile, cfg: ModelConfig, dtypes: tuple[str, str],
                      placement: Placement, activations: Activations, work: GrpoWork,
                      gen_profile: MachineProfile | None = None) -> GrpoStep:
    """One step of `work` on this machine: each part as the run does it (see the module). dtypes: the store's and
    the compute's (phantom.base.dtypes names). gen_profile: the
    machine measured beside a light compute, for the generation (default: `profile`): a decode step's few rows leave
    the cores to the loaders, where a training step's compute slows its reads (a profile measured at a 16 x 131-token
    step of 7B-shaped blocks predicted the disk tier's generation at twice its time)."""
    rows, (store_dtype, dtype) = work.prompts * work.num_generations, dtypes
    gen_shape = shape_of(cfg, store_dtype, dtype, seq_len=1)
    gen = predict_generation(rates, gen_profile or profile, gen_shape, placement, rows, work.prompt_len,
                             work.completion_len, rows)
    shape = shape_of(cfg, store_dtype, dtype, seq_len=work.prompt_len + work.completion_len - 1)
    train = costmodel.predict(profile, shape, placement, activations, rows)
    forward_s, forward_bytes = forward_pass(profile, shape, placement, activations, rows)
    reference_s = work.reference_passes * forward_s / work.num_iterations
    beside = shape.n_blocks * nograd_block_s(profile, shape, activations, rows) if work.base_reference else 0.0
    gen_bytes = gen.loads * gen_shape.block_bytes if "disk" in costmodel.layout(gen_shape, profile, placement).tiers \
        else 0
    bytes_read = gen_bytes / work.num_iterations + work.reference_passes * forward_bytes / work.num_iterations + \
        train.bytes_read
    return GrpoStep(generation_s=gen.seconds / work.num_iterations, reference_s=reference_s,
                    train_s=train.step_s + beside, bytes_read=int(bytes_read))


def nograd_block_s(profile: MachineProfile, shape, activations: Activations, rows: int) -> float:
    """One block's forward without autograd over `rows` rows (calls of micro_batch rows)."""
    calls = -(-rows // (activations.micro_batch or rows))
    return calls * profile.fwd_call_s + rows * shape.flops_per_row / profile.fwd_flops


def forward_pass(profile: MachineProfile, shape, placement: Placement, activations: Activations,
                 rows: int) -> tuple[float, int]:
    """(seconds, bytes read) of a forward without autograd over `rows` rows and the head: every streamed block
    loaded once (in the rhythm of passes that follow one another), the rest computing where they are."""
    lay = costmodel.layout(shape, profile, placement)
    c = nograd_block_s(profile, shape, activations, rows)
    loads = list(cycle_loads(lay.streamed, lay.slots))
    t = LoadTimes.of_block(profile, shape, lay.tiers, warm=False)
    still = shape.n_blocks - len(lay.streamed)
    head = rows * shape.head_flops_per_row / 2 / (profile.head_flops or profile.fwd_flops)  # logits, no gradient
    seconds = still * c + costmodel.pipe_s([c] * shape.n_blocks, loads, lay, t, profile) + head
    read = sum(1 for i in loads if lay.tiers[i] == "disk") * shape.block_bytes
    return seconds, read
