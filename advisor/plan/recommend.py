"""What `advisor recommend` takes from the planner: for a decoder on GPUs, the fastest plan that fits, as a
TrainingConfig the trial runner can run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisor.plan.knobs import Offload, PlanConfig
from advisor.trial import TrainingConfig

if TYPE_CHECKING:
    from advisor.plan.model import Plan, PlanResult
    from advisor.workload import DecoderArch, Workload


def planned_arch(workload: "Workload", spec: str | None = None,
                 args: dict[str, Any] | None = None) -> "DecoderArch | None":
    """The decoder shape the planner plans `workload` as: its own, or, where the workload args carry a fine-tune
    (advisor.finetune.finetuned leaves no shape on the workload), that of `spec` built without it; for a Hugging
    Face causal LM (`hf:` spec), the advisor's decoder of its shape; None for a model that is not a decoder."""
    from advisor.finetune import finetune_of, with_finetune

    hf = spec is not None and spec.startswith("hf:")
    if workload.decoder is not None or spec is None or (finetune_of(args) is None and not hf):
        return workload.decoder
    from advisor.workload import load_workload

    base = load_workload(spec, with_finetune(args, None))
    if hf:
        from advisor.presets.hf import hf_decoder_arch

        return hf_decoder_arch(base)
    return base.decoder


def plans_for(workload: "Workload", hardware: str, spec: str | None = None,
              args: dict[str, Any] | None = None) -> "PlanResult":
    """The planner's answer for `workload` (a decoder, or a fine-tune of one: `spec` and its `args`, as
    `planned_arch` takes them) on `hardware` as asked (NAME:N or NAME:NxM), at the default global batch, without
    offload (a trial cannot run it); a fine-tune, and a Hugging Face model (whose modules the trial's tensor and
    pipeline plans do not know), are planned data parallel, as their trials run."""
    from advisor.finetune import finetune_of
    from advisor.plan.knobs import FixedKnobs
    from advisor.plan.model import PlanRequest
    from advisor.plan.search import plan

    whole = dict(tp=1, pp=1, cp=1) if spec is not None and spec.startswith("hf:") else {}
    return plan(PlanRequest(arch=planned_arch(workload, spec, args), finetune=finetune_of(args), hardware=[hardware],
                            top=1, fixed=FixedKnobs(offload=Offload.none, **whole)))


def training_config(config: PlanConfig) -> TrainingConfig:
    """The trial configuration that runs `config` on CUDA devices: one process per device, each data-parallel
    replica's step of micro_batch_size x microbatches samples (pp) or micro_batch_size, grad_accum times."""
    if config.offload != Offload.none:
        raise ValueError("a plan with offload has no trial configuration")
    pp = config.pp > 1
    return TrainingConfig(device="cuda", nproc=config.world, strategy=config.strategy, tp=config.tp, pp=config.pp,
                          cp=config.cp, dp_replicate=config.dp_replicate,
                          pp_schedule=config.schedule or TrainingConfig.model_fields["pp_schedule"].default,
                          virtual_stages=config.virtual_stages,
                          batch_size=config.micro_batch_size * (config.microbatches if pp else 1),
                          micro_batch_size=config.micro_batch_size if pp else None, grad_accum=config.grad_accum,
                          checkpointing=config.checkpointing, precision=config.precision,
                          optimizer=config.optimizer, optimizer_impl="fused",
                          sequence_parallel=config.sequence_parallel if config.tp > 1 else True)


def describe(plan: "Plan", result: "PlanResult") -> str:
    """The reason a planned recommendation gives."""
    c = plan.config
    b = plan.breakdown
    return (f"planned: the fastest plan that fits ({result.considered} configurations sized, {result.timed} timed) "
            f"at {result.global_batch_size} samples a step: {c.label()}, micro-batch {c.micro_batch_size}"
            + (f" x {c.grad_accum} accumulated" if c.grad_accum > 1 else "")
            + f", checkpointing {c.checkpointing.value}; {plan.step_time_s:.2f} s a step (compute {b.compute_s:.2f}, "
            f"exposed communication {b.exposed_comm_s:.2f}, bubble {b.bubble_s:.2f}, optimizer {b.optimizer_s:.2f}), "
            f"{plan.memory_per_device_bytes / 2**30:.1f} GiB a device; memory from the analytic estimator, time from "
            "the step-time model (docs/planner.md)")
