"""The planner's search: every configuration of a decoder on each hardware target (space.py), pruned by memory
before its step is timed, ranked by throughput per device or by cost per token.

Within a family (everything but the micro-batch, checkpointing and offload), micro-batches grow until one fits
with no checkpointing mode; at each size, the least recompute that fits is kept (more recompute is slower and
holds less, nothing else). The optimizer is offloaded only where nothing fits on the device otherwise.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from advisor.errors import SpecError, invalid_input
from advisor.estimate.parallel_tuned import Tuning
from advisor.hardware.spec import HardwareSpec
from advisor.plan.knobs import FixedKnobs, Offload, PlanConfig
from advisor.plan.memory import DeviceMemory, device_memory, held_bytes, peak_ranks, usable_bytes
from advisor.plan.model import DEFAULT_TOKENS_PER_STEP, Objective, Plan, PlanRequest, PlanResult
from advisor.plan.space import CHECKPOINTING, Family, Rejections, families
from advisor.workload import DecoderArch

__all__ = ["Plan", "PlanRequest", "PlanResult", "plan", "resolve", "resolve_arch", "targets"]
LAYOUT_KNOBS = ("tp", "pp", "cp", "dp_replicate")  # what a fine-tune's trial cannot run above 1


@dataclass
class Found:
    """One target's search: the fitting plans, else the closest (least memory) configurations."""

    fitting: list[Plan] = field(default_factory=list)
    closest: list[tuple[PlanConfig, DeviceMemory]] = field(default_factory=list)
    hopeless: list[tuple[int, PlanConfig]] = field(default_factory=list)  # (floor bytes, config) over the device
    considered: int = 0
    timed: int = 0
    fits: bool = False  # some configuration fits (the board may have kept none of them)
    offloaded: bool = False


@dataclass
class Board:
    """The best `top` scores so far, over every target: a configuration that cannot enter them need not have its
    memory computed."""

    top: int
    objective: Objective
    scores: list[float] = field(default_factory=list)  # ascending, at most `top` (lower is better)

    def score(self, plan: Plan) -> float:
        value = getattr(plan, self.objective.value)
        return -value if self.objective.maximize else value

    def admits(self, plan: Plan) -> bool:
        return len(self.scores) < self.top or self.score(plan) < self.scores[-1]

    def add(self, plan: Plan) -> None:
        bisect.insort(self.scores, self.score(plan))
        del self.scores[self.top:]


def plan(request: PlanRequest) -> PlanResult:
    """The top `request.top` plans over every target; SpecError (one line) for input no configuration can take."""
    t0 = time.perf_counter()
    arch, name, tuning = resolve(request)
    batch = request.global_batch_size or default_global_batch(arch)
    hardware = targets(request)
    priced = all(hw.accelerator.name in request.prices for hw in hardware)
    objective = request.objective or (Objective.cost_per_million_tokens if priced
                                      else Objective.tokens_per_s_per_device)
    if objective == Objective.cost_per_million_tokens and not priced:
        raise SpecError(f"ranking by cost needs a price for every hardware; priced: "
                        f"{', '.join(request.prices) or 'none'}")
    board = Board(request.top, objective)
    plans, closest, considered, timed, notes, fits, failed = [], [], 0, 0, [], False, []
    if (request.workload or "").startswith("hf:"):
        notes.append(f"{name}: planned as the advisor's decoder of the config's shape (its layers, widths, heads, "
                     "vocabulary and norm), not transformers' own modules")
    if tuning is not None:
        notes.append(f"{name}: a fine-tune is planned data parallel only (one device, ddp, zero1, zero2, zero3; no "
                     "tp, pp, cp or HSDP), the layouts its trial runs; frozen parameters get no gradient, optimizer "
                     "state or reduction")
    for hw in hardware:
        target = Target(arch, hw, usable_bytes(hw, request.margin), request.prices.get(hw.accelerator.name),
                        tuning)
        try:
            found = search(target, batch, request.fixed, board)
        except SpecError as exc:  # one target of several: the others may take the batch and the fixed knobs
            if len(hardware) == 1:
                raise
            notes.append(f"{_label(hw)}: {exc}")
            failed.append(notes[-1])
            continue
        considered, timed = considered + found.considered, timed + found.timed
        plans += found.fitting
        fits = fits or found.fits
        closest += [target.plan(c, m) for c, m in found.closest]
        if found.offloaded:
            notes.append(f"{_label(hw)}: nothing fits with the optimizer on the device; these plans offload it")
    if len(failed) == len(hardware):  # no target could take them
        raise SpecError(failed[0])
    # plans whose scores agree to four significant figures tie (the model is not finer than that): the one needing
    # less memory first, then the one with fewer ranks that are not plain data parallel
    ranked = sorted(plans, key=lambda p: (float(f"{board.score(p):.4g}"), p.memory_per_device_bytes,
                                          p.config.world // p.config.dp))[:request.top]
    advice: list[str] = []
    if not fits:
        from advisor.plan.advice import what_would_fit

        ranked = sorted(closest, key=lambda p: p.memory_per_device_bytes)[:request.top]
        largest = {hw.accelerator.name: hw for hw in hardware}  # each type's largest target (listed ascending)
        for hw in largest.values():
            advice += what_would_fit(arch, hw, batch, request.fixed, usable_bytes(hw, request.margin), tuning)
    return PlanResult(workload=name, global_batch_size=batch, tokens_per_step=batch * arch.seq_len,
                      objective=objective, plans=ranked, fits=fits, what_would_fit=advice, notes=notes,
                      considered=considered, timed=timed, seconds=time.perf_counter() - t0)


@dataclass(frozen=True)
class Target:
    """A decoder on one hardware target: what a plan's memory and step are computed against."""

    arch: DecoderArch
    hw: HardwareSpec
    usable: int  # bytes per device a plan may take
    price: float | None  # USD per device-hour
    tuning: Tuning | None = None  # a fine-tune's frozen parts and adapters (advisor/plan/tuning.py)

    def memory(self, config: PlanConfig) -> DeviceMemory:
        return device_memory(self.arch, self.hw, config, self.usable, peak_ranks(config.layout()), self.tuning)

    def plan(self, config: PlanConfig, mem: DeviceMemory | None = None) -> Plan:
        """`config`'s plan: its step predicted (advisor/plan/steptime.py), and its memory (`mem`, else a
        placeholder of 0 bytes that does not fit, for a step timed before its memory)."""
        from advisor.estimate.roofline import peak_flops
        from advisor.plan.steptime import predict_step

        hw = self.hw
        step = predict_step(self.arch, hw, config.layout(), micro_batch_size=config.micro_batch_size,
                            grad_accum=config.grad_accum, precision=config.precision,
                            checkpointing=config.checkpointing, optimizer=config.optimizer,
                            offload_optimizer=config.offload == Offload.optimizer, tuning=self.tuning)
        tokens, seconds = config.global_batch * self.arch.seq_len, step.step_time_s
        peak = peak_flops(hw, config.precision)
        cost = None if self.price is None else self.price * hw.world_size * seconds / 3600 / tokens * 1e6
        return Plan(hardware=_label(hw), devices=hw.world_size, config=config,
                    memory_per_device_bytes=mem.total if mem else 0, memory=mem.parts if mem else {},
                    usable_bytes=self.usable, fits=mem.fits if mem else False, step_time_s=seconds,
                    tokens_per_s_per_device=tokens / seconds / hw.world_size,
                    samples_per_s=config.global_batch / seconds,
                    mfu=step.flops_per_device / seconds / peak if peak else None, breakdown=step.breakdown,
                    cost_per_million_tokens=cost)


def search(target: Target, global_batch: int, fixed: FixedKnobs, board: Board, keep_closest: int = 5) -> Found:
    """The configurations on `target` that fit (offloading the optimizer only where none fits otherwise, unless
    `fixed` holds offload) and may rank among `board`'s best. SpecError where `fixed` and the global batch leave
    no configuration at all."""
    why = Rejections()
    found = Found()
    offloads = [fixed.offload] if fixed.offload is not None else [Offload.none, Offload.optimizer]
    modes = [fixed.checkpointing] if fixed.checkpointing is not None else list(CHECKPOINTING)
    fams = list(families(target.arch, target.hw, global_batch, fixed, why, dp_only=target.tuning is not None))
    if not fams:
        raise SpecError(why.first or f"no configuration on {_label(target.hw)} satisfies the held knobs "
                        f"{' '.join(f'{k}={v}' for k, v in fixed.given().items())}")
    # pipelines last, interleaved ones after the rest: their memory costs the most to compute (a walk through
    # the schedule), and by then the board holds the best of the others
    fams.sort(key=lambda f: (f.base.pp > 1, f.base.virtual_stages > 1))
    for offload in offloads:
        for fam in fams:
            _grow(target, fam, modes, offload, board, found)
        if found.fits:
            found.offloaded = offload != Offload.none and fixed.offload is None
            break
    if not found.fits:  # the closest: the least memory among those computed and those over at their floor
        found.closest += [(c, target.memory(c)) for _, c in sorted(found.hopeless, key=lambda fc: fc[0])[:keep_closest]]
    found.closest = sorted(found.closest, key=lambda cm: cm[1].total)[:keep_closest] if not found.fits else []
    return found


def _grow(target: Target, fam: Family, modes: list, offload: Offload, board: Board, found: Found) -> None:
    """Micro-batches of `fam` from the smallest, each with the least recompute that fits, until none fits.
    The family's least memory (smallest size, most recompute) is tried first: most families do not fit at all.
    A mode that did not fit one size does not fit a larger one: it starts where the last size ended. Under pp,
    once the board is full, the step is timed first (it costs a fraction of the memory's walk through the
    schedule), and a size whose least recompute cannot enter the board is passed over (more recompute is slower)."""
    least = fam.config(fam.sizes[0], modes[-1], offload)
    floor = held_bytes(target.arch, target.hw, least, target.tuning)
    if floor > target.usable:
        found.hopeless.append((floor, least))
        return
    known = {least: target.memory(least)}
    found.considered += 1
    if not known[least].fits:
        found.closest.append((least, known[least]))
        return
    first = 0
    for size in fam.sizes:
        if fam.base.pp > 1 and len(board.scores) == board.top:
            found.timed += 1
            if not board.admits(target.plan(fam.config(size, modes[first], offload))):
                continue
        for i in range(first, len(modes)):
            config = fam.config(size, modes[i], offload)
            mem = known.get(config) or target.memory(config)
            found.considered += config not in known
            if mem.fits:
                first, found.fits = i, True
                found.timed += 1
                timed = target.plan(config, mem)
                if board.admits(timed):
                    board.add(timed)
                    found.fitting.append(timed)
                break
        else:
            return


def default_global_batch(arch: DecoderArch) -> int:
    """DEFAULT_TOKENS_PER_STEP tokens' worth of samples, rounded down to a power of 2 (at least 1)."""
    samples = max(DEFAULT_TOKENS_PER_STEP // arch.seq_len, 1)
    return 1 << (samples.bit_length() - 1)


def resolve(request: PlanRequest) -> tuple[DecoderArch, str, Tuning | None]:
    """The decoder's shape, its name (with +lora or +freeze, as advisor.finetune.finetuned names it) and its
    fine-tune as the analytic model counts it (None: full training). SpecError, one line, for a fine-tune the
    decoder cannot take, or with a layout knob held above 1 (its trial runs data parallel only)."""
    from advisor.finetune import finetune_of, with_finetune
    from advisor.plan.tuning import tuning_of

    spec = request.finetune or finetune_of(request.workload_args)
    base = request.model_copy(update={"workload_args": with_finetune(request.workload_args, None)})
    arch, name, model_type = _resolve(base)
    tuning = tuning_of(spec, arch, model_type, name)
    if tuning is None:
        return arch, name, None
    held = {k: v for k in LAYOUT_KNOBS if (v := getattr(request.fixed, k)) not in (None, 1)}
    if held:
        knob, value = next(iter(held.items()))
        raise SpecError(f"{knob}={value} with a fine-tune: its trial runs the fine-tuned model on one device or data "
                        f"parallel (ddp, zero1, zero2, zero3), not with {', '.join(LAYOUT_KNOBS)} above 1; hold "
                        f"{knob} at 1 or leave it free")
    return arch, name + ("+lora" if spec.lora is not None else "+freeze"), tuning


def resolve_arch(request: PlanRequest) -> tuple[DecoderArch, str]:
    """The decoder's shape and name: `arch`, a preset built here, or a workload file described in a worker."""
    arch, name, _ = _resolve(request)
    return arch, name


def _resolve(request: PlanRequest) -> tuple[DecoderArch, str, str | None]:
    """resolve_arch's, with the model type that names its modules (plan/tuning.py): an hf: config's, "advisor"
    for a preset's decoder, None for a shape given as `arch` or a workload file's model (whose names the planner
    cannot see)."""
    model_type = None
    if request.arch is not None:
        return request.arch, "decoder", None
    spec = request.workload
    if spec.startswith("hf:"):  # a config read as data, built by transformers' own classes: no user code
        import inspect

        from advisor.presets.hf import hf_decoder_arch
        from advisor.workload import load_workload

        wl = load_workload(spec, request.workload_args)
        arch, name = hf_decoder_arch(wl), wl.name
        model_type = getattr(getattr(inspect.unwrap(wl.build_model), "config", None), "model_type", None)
    elif ":" in spec:  # the user's code runs in an isolated worker
        from advisor.isolation import describe

        info = describe(spec, request.workload_args)
        arch, name = info.decoder, info.name
    else:
        from advisor.workload import load_workload

        wl = load_workload(spec, request.workload_args)
        arch, name, model_type = wl.decoder, wl.name, "advisor"
    if arch is None:
        raise SpecError(f"{spec} is not a decoder; the planner covers decoder models: the gpt2-*, llama-* and "
                        "decoder presets (-w decoder -a layers=... -a hidden=...), and hf: causal LMs of the llama, "
                        "mistral, qwen2, qwen3, gpt2 and gpt_neox families")
    return arch, name, model_type


def targets(request: PlanRequest) -> list[HardwareSpec]:
    """Each hardware spec, at each node count of `request.nodes` (its devices per node as NAME:N gives them)."""
    from pydantic import ValidationError

    from advisor.hardware import get_hardware

    out = []
    for spec in request.hardware:
        hw = get_hardware(spec)
        if hw.device_type != "cuda":
            raise SpecError(f"{spec}: the planner plans GPU training; give a GPU from the catalog (advisor hardware)")
        if request.nodes is None:
            out.append(hw)
            continue
        if hw.nodes > 1 or ":" not in spec:
            raise SpecError(f"hardware {spec} with a node range: give the devices per node only, e.g. "
                            f"{hw.accelerator.name}:8")
        try:
            out += [hw.model_copy(update={"nodes": n}) for n in range(request.nodes[0], request.nodes[1] + 1)]
        except ValidationError as exc:
            raise invalid_input(exc) from exc
    return out


def _label(hw: HardwareSpec) -> str:
    return f"{hw.accelerator.name}:{hw.devices_per_node}x{hw.nodes}"
