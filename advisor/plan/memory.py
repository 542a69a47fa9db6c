"""Per-device memory of a plan: the analytic decoder formulas (advisor/estimate/parallel_analytic.py) at the
fullest pipeline rank, with the allocator model and CUDA context that estimate_layout adds to a synthetic trace."""

from __future__ import annotations

from dataclasses import dataclass

from advisor.estimate.cuda_alloc import RUNTIME_BYTES
from advisor.estimate.overhead import SYNTHETIC_RESERVED_RATIO
from advisor.estimate.parallel_analytic import analytic_rank
from advisor.estimate.parallel_tuned import Tuning
from advisor.hardware.spec import HardwareSpec
from advisor.parallel.layout import Layout
from advisor.plan.knobs import Offload, PlanConfig
from advisor.workload import DecoderArch


@dataclass(frozen=True)
class DeviceMemory:
    """What the fullest device of a plan holds at its peak (bytes)."""

    # parameters, gradients, optimizer_state, activations, temporaries, overhead, runtime, nccl
    parts: dict[str, int]
    total: int  # reserved by the allocator plus the CUDA context: what the device must have free
    fits: bool


def usable_bytes(hw: HardwareSpec, margin: float | None = None) -> int:
    """Device memory a plan may take: estimate_layout's, the margin (settings.memory_margin) kept free."""
    from advisor.estimate.estimator import _margin
    from advisor.estimate.model import EstimateOptions

    return int(hw.memory_per_device_bytes * (1 - _margin(EstimateOptions(margin=margin))))


def device_memory(arch: DecoderArch, hw: HardwareSpec, config: PlanConfig, usable: int,
                  ranks: tuple[int, ...] | None = None, tuning: Tuning | None = None) -> DeviceMemory:
    """The peak over the pipeline ranks `ranks` (default: every one; `peak_ranks` those that can hold it) of
    `config`, as estimate_layout(method="analytic") predicts it with the optimizer fused on CUDA; `tuning`: a
    fine-tune's frozen parts and adapters (advisor/plan/tuning.py)."""
    from advisor.estimate.nccl import layout_bytes

    cuda = hw.device_type == "cuda"
    layout = config.layout()
    best: tuple[int, int, dict[str, int]] | None = None
    for pp_rank in ranks if ranks is not None else range(config.pp):
        parts = rank_peak(arch, config, pp_rank, hw.device_type, tuning)
        nccl = layout_bytes(hw, layout, pp_rank) if cuda else 0
        reserved = int(sum(parts.values()) * SYNTHETIC_RESERVED_RATIO) if cuda else sum(parts.values())
        if best is None or reserved + nccl > best[0] + best[1]:
            best = (reserved, nccl, parts)
    reserved, nccl, peak = best
    runtime = RUNTIME_BYTES if cuda else 0
    parts = {**peak, "overhead": reserved - sum(peak.values()), "runtime": runtime, "nccl": nccl}
    total = reserved + runtime + nccl
    return DeviceMemory(parts=parts, total=total, fits=total <= usable)


def held_bytes(arch: DecoderArch, hw: HardwareSpec, config: PlanConfig, tuning: Tuning | None = None) -> int:
    """A floor under the peak of `config`: what its first or last pipeline rank holds throughout the step (its
    parameters at rest and optimizer state), as reserved on CUDA, context included (bytes). It takes no walk
    through the schedule, as rank_peak does, and rules out most meshes of a large model at a fraction of the cost."""
    from advisor.estimate.nccl import layout_bytes
    from advisor.estimate.parallel_analytic import rank_memory
    from advisor.estimate.parallel_moments import StepKnobs

    cuda = hw.device_type == "cuda"
    knobs = StepKnobs(config.grad_accum, config.offload == Offload.optimizer, False)
    held = 0
    for pp_rank in sorted({0, config.pp - 1}):
        mem, _ = rank_memory(arch, config.layout(), pp_rank, config.micro_batch_size * config.microbatches,
                             precision=config.precision, optimizer=config.optimizer,
                             checkpointing=config.checkpointing, optimizer_impl="fused" if cuda else None,
                             device_type=hw.device_type, knobs=knobs, tuning=tuning)
        held = max(held, mem.params + mem.state)
    # the NCCL buffers every rank holds at least: those of its pipeline's first (or only) rank
    return int(held * SYNTHETIC_RESERVED_RATIO) + RUNTIME_BYTES + layout_bytes(hw, config.layout(), 0) if cuda \
        else held


def rank_peak(arch: DecoderArch, config: PlanConfig, pp_rank: int, device_type: str,
              tuning: Tuning | None = None) -> dict[str, int]:
    """analytic_rank's peak breakdown of pipeline rank `pp_rank` (bytes). Its walk through the schedule costs time
    in proportion to the micro-batches; past the warm-up, each micro-batch adds the same bytes to the peak (its
    token ids; the interleaved schedule's kept sends), so with more than 3 pp micro-batches the peak is taken at
    2 pp and 3 pp and extended, which equals the walk (tests/advisor/test_plan_search.py)."""
    m, low, high = config.microbatches, 2 * config.pp, 3 * config.pp
    if config.pp == 1 or m <= high:
        return _analytic(arch, config, pp_rank, device_type, tuning)
    a = _analytic(arch, config.model_copy(update={"microbatches": low}), pp_rank, device_type, tuning)
    b = _analytic(arch, config.model_copy(update={"microbatches": high}), pp_rank, device_type, tuning)
    return {k: b[k] + (b[k] - a[k]) * (m - high) // (high - low) for k in b}


def _analytic(arch: DecoderArch, config: PlanConfig, pp_rank: int, device_type: str,
              tuning: Tuning | None = None) -> dict[str, int]:
    # analytic_rank's batch is a replica's samples per micro-step: under pp, all the pipeline's micro-batches
    batch = config.micro_batch_size * (config.microbatches if config.pp > 1 else 1)
    parts, _ = analytic_rank(arch, config.layout(), pp_rank, batch, precision=config.precision,
                             optimizer=config.optimizer, checkpointing=config.checkpointing,
                             optimizer_impl="fused" if device_type == "cuda" else None, device_type=device_type,
                             grad_accum=config.grad_accum, offload_optimizer=config.offload == Offload.optimizer,
                             tuning=tuning)
    return parts


def peak_ranks(layout: Layout) -> tuple[int, ...]:
    """The pipeline ranks whose peak can be the largest when the layers split evenly, or with the remainder to the
    first stages (Layout.split: no later rank holds more layers than the second): the first (embedding, most
    micro-batches in flight), the second (the most in flight of the ranks holding layers alone: 1F1B's warm-up
    shrinks with the rank) and the last (the output layer and the loss)."""
    return tuple(sorted({0, min(1, layout.pp - 1), layout.pp - 1}))
