"""`recommend`: how to train a workload on each candidate hardware type, and which is fastest (or
cheapest) per epoch. Each answer says where it comes from: `measured` (the stored best for this
workload and hardware fingerprint), `transferred` (a stored best of the same workload on other
hardware, or of a same-named workload on this hardware, adjusted by the estimator), or
`planned` (a decoder on GPUs, a Hugging Face causal LM or a fine-tune of either included: the planner's fastest
plan that fits, its memory from the analytic estimator and its time from the step-time model), or `estimated`
(estimator and roofline only). The CLI and the HTTP API both call `recommend`."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import AdvisorError, SpecError
from advisor.trial import TrainingConfig

if TYPE_CHECKING:
    from advisor.estimate import MemoryEstimate
    from advisor.hardware.spec import HardwareSpec
    from advisor.store import BestRecord, ResultStore
    from advisor.workload import Workload

Provenance = Literal["measured", "transferred", "planned", "estimated"]
PER_SAMPLES = 1_000_000  # the "epoch" when the workload has no dataset (samples)
THROUGHPUT_METRICS = ("samples_per_s", "tokens_per_s")
MAX_SOURCES = 3  # stored bests tried, in order of preference, before falling back to the estimator


class Recommendation(BaseModel):
    """One recommended configuration for one hardware type, with what it is expected to achieve."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: str = Field(description="The hardware as asked for (catalog name[:devices]).")
    provenance: Provenance
    config: TrainingConfig
    fits: bool = Field(description="Whether the configuration is expected to fit in device memory.")
    samples_per_s: float | None = Field(default=None, description="Expected samples per second, all ranks (samples/s).")
    tokens_per_s: float | None = Field(
        default=None, description="samples_per_s x tokens_per_sample, where the workload says (tokens/s).")
    peak_memory_bytes: int | None = Field(
        default=None, description="Expected peak per device, as docs/design.md measures it (bytes).")
    epoch_samples: int = Field(gt=0, description="Samples in the epoch the times are given for (samples).")
    epoch_basis: Literal["dataset", "per_1e6_samples"] = Field(
        description="'dataset': one pass over the workload's dataset; 'per_1e6_samples': no dataset, 1e6 samples.")
    time_per_epoch_s: float | None = Field(default=None, description="epoch_samples / samples_per_s (s).")
    price_per_device_hour: float | None = Field(default=None, ge=0, description="As given (USD per device-hour).")
    devices: int = Field(ge=1, description="Devices the configuration occupies, billed by the hour (count).")
    cost_per_epoch: float | None = Field(default=None, description="time_per_epoch_s x devices x price / 3600 (USD).")
    reason: str = Field(description="Where the figures come from, and what was changed to get here.")
    source_trial_id: int | None = Field(default=None, description="The stored trial measured or transferred from.")
    source_hardware: str | None = Field(default=None, description="Hardware the source trial ran on.")


@dataclass
class _Target:
    """What every hardware candidate shares: the workload, its fingerprint and epoch, the store."""

    store: "ResultStore"
    workload: "Workload"
    spec: str
    args: dict[str, Any]
    fp: str
    epoch: int | None  # dataset length (samples), None without a dataset


def recommend(workload: str, hardware: str | list[str], *, workload_args: dict[str, Any] | None = None,
              db: "str | ResultStore | None" = None, prices: dict[str, float] | None = None) -> list[Recommendation]:
    """One Recommendation per hardware candidate, best first: by cost per epoch where prices are
    given (candidates without a price after those with one), else by time per epoch; those that
    fit before those that do not. `prices`: USD per device-hour, keyed as in `hardware`. `db`: a
    database URL (opened and closed here) or an open store (left open: the API's)."""
    from advisor.fingerprint import workload_fingerprint
    from advisor.hardware import get_hardware
    from advisor.store import open_store
    from advisor.workload import dataset_length, load_workload

    names, prices = check_candidates(hardware, prices)
    targets = {name: get_hardware(name) for name in names}
    args = dict(workload_args or {})
    wl = load_workload(workload, args)
    with nullcontext(db) if db is not None and not isinstance(db, str) else open_store(db) as store:
        target = _Target(store=store, workload=wl, spec=workload, args=args, fp=workload_fingerprint(wl),
                         epoch=dataset_length(wl))
        recs = [_priced(_for_hardware(target, name, hw), prices.get(name)) for name, hw in targets.items()]
    return rank(recs)


def check_candidates(hardware: str | list[str], prices: dict[str, float] | None) -> tuple[list[str], dict[str, float]]:
    """The candidates' names, once each, and their prices; the SpecError of a bad name, count or price, raised
    without probing this machine or loading the workload (a caller checks before it starts a worker)."""
    from advisor.hardware import check_hardware

    names = _names(hardware)
    for name in names:
        check_hardware(name)
    return names, _check_prices(prices or {}, names)


def _names(hardware: str | list[str]) -> list[str]:
    names = [hardware] if isinstance(hardware, str) else list(hardware)
    names = list(dict.fromkeys(n.strip() for n in names))
    if not names or not all(names):
        raise SpecError("give at least one hardware name (e.g. a100-80gb); `advisor hardware` lists them")
    return names


def _check_prices(prices: dict[str, float], names: list[str]) -> dict[str, float]:
    for name, price in prices.items():
        if name not in names:
            raise SpecError(f"a price is given for {name!r}, which is not a candidate; candidates: {', '.join(names)}")
        if not isinstance(price, (int, float)) or not 0 <= price < float("inf"):
            raise SpecError(f"price for {name} is {price!r}; give USD per device-hour, a number >= 0")
    return {k: float(v) for k, v in prices.items()}


def rank(recs: list[Recommendation]) -> list[Recommendation]:
    """Fitting first; then by cost per epoch when any price is given, then time per epoch (unknowns last)."""
    priced = any(r.cost_per_epoch is not None for r in recs)
    inf = float("inf")

    def key(r: Recommendation) -> tuple:
        cost = r.cost_per_epoch if r.cost_per_epoch is not None else inf
        time = r.time_per_epoch_s if r.time_per_epoch_s is not None else inf
        return (not r.fits, cost, time) if priced else (not r.fits, time)

    return sorted(recs, key=key)


def _priced(rec: Recommendation, price: float | None) -> Recommendation:
    if price is None or rec.time_per_epoch_s is None:
        return rec.model_copy(update={"price_per_device_hour": price})
    cost = rec.time_per_epoch_s / 3600 * rec.devices * price
    return rec.model_copy(update={"price_per_device_hour": price, "cost_per_epoch": cost})


def _for_hardware(t: _Target, name: str, hw: "HardwareSpec") -> Recommendation:
    from advisor.store import hardware_fingerprint

    hw_fp = hardware_fingerprint(hw)
    mine = _throughput_bests(t.store.best(workload=t.fp, hardware=hw_fp))
    if mine:
        return _measured(t, name, hw, mine[0])
    tried: list[str] = []
    for source in _sources(t, hw, hw_fp)[:MAX_SOURCES]:
        try:
            return _transferred(t, name, hw, source)
        except AdvisorError as exc:
            tried.append(f"trial {source.trial.id} on {source.trial.hardware_name} not transferable ({exc})")
    return _estimated(t, name, hw, tried)


def _throughput_bests(bests: list["BestRecord"]) -> list["BestRecord"]:
    """Bests of throughput objectives (first metric samples/s or tokens/s, maximized), fastest first."""
    from advisor.store import Objective

    def is_throughput(b: "BestRecord") -> bool:
        first = Objective.parse(b.objective).metrics[0]
        return first.name in THROUGHPUT_METRICS and first.direction == "maximize"

    found = [b for b in bests if is_throughput(b) and b.trial.samples_per_s]
    return sorted(found, key=lambda b: (-(b.trial.samples_per_s or 0.0), b.trial.id))


def _sources(t: _Target, hw: "HardwareSpec", hw_fp: str) -> list["BestRecord"]:
    """Stored bests to transfer from: the same workload on other hardware (same device type and
    accelerator first, then nearest in memory), then same-named workloads of another fingerprint here."""
    import math

    def distance(b: "BestRecord") -> tuple:
        spec = t.store.hardware_spec(b.hardware_fp) or {}
        acc = spec.get("accelerator", {})
        same_type = (acc.get("vendor") == "cpu") == (hw.device_type == "cpu")
        memory = acc.get("memory_bytes") or 1
        return (not same_type, acc.get("name") != hw.accelerator.name,
                abs(math.log(memory / hw.accelerator.memory_bytes)), b.trial.id)

    elsewhere = [b for b in _throughput_bests(t.store.best(workload=t.fp)) if b.hardware_fp != hw_fp]
    similar = [b for b in _throughput_bests(t.store.best(hardware=hw_fp))
               if b.workload_fp != t.fp and b.trial.workload_name == t.workload.name]
    return sorted(elsewhere, key=distance) + similar


def _epoch_fields(t: _Target, samples_per_s: float | None) -> dict[str, Any]:
    n = t.epoch or PER_SAMPLES
    return {"epoch_samples": n, "epoch_basis": "dataset" if t.epoch else "per_1e6_samples",
            "time_per_epoch_s": n / samples_per_s if samples_per_s else None}


def _throughput_fields(t: _Target, samples_per_s: float | None) -> dict[str, Any]:
    tps = t.workload.tokens_per_sample
    return {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * tps if samples_per_s and tps else None,
            **_epoch_fields(t, samples_per_s)}


def _devices(config: TrainingConfig) -> int:
    return config.nproc if config.device == "cuda" else 1  # CPU ranks share one host


def _measured(t: _Target, name: str, hw: "HardwareSpec", best: "BestRecord") -> Recommendation:
    trial = best.trial
    fields = _throughput_fields(t, trial.samples_per_s)
    if trial.tokens_per_s is not None:
        fields["tokens_per_s"] = trial.tokens_per_s
    reason = (f"measured: the stored best ({best.objective}) of study {trial.study_name}, trial {trial.id}, "
              f"for this workload and hardware fingerprint")
    return Recommendation(hardware=name, provenance="measured", config=trial.config, fits=True,
                          peak_memory_bytes=trial.peak_memory_bytes, devices=_devices(trial.config), reason=reason,
                          source_trial_id=trial.id, source_hardware=trial.hardware_name, **fields)


def _transferred(t: _Target, name: str, hw: "HardwareSpec", source: "BestRecord") -> Recommendation:
    from advisor.transfer import adapt, rescale_batch, with_batch

    trial = source.trial
    src_hw, src_wl = _source_target(t, source)
    config, notes = adapt(trial.config, src_hw, hw, t.workload)
    src_est = _estimate(src_wl, src_hw, trial.config)
    first = _estimate(t.workload, hw, config)
    batch = rescale_batch(trial.config.batch_size, src_est.max_batch_size, first.max_batch_size,
                          cap=_batch_cap(t, config))
    if batch == 0:
        raise SpecError(f"no batch fits on {hw.accelerator.name} with its knobs")
    config = with_batch(config, batch) if batch != config.batch_size else config
    est = first if config.batch_size == trial.config.batch_size else _estimate(t.workload, hw, config)
    config, est = _settle(t.workload, hw, config, est)
    if config.batch_size != trial.config.batch_size:
        notes.append(f"batch {trial.config.batch_size} -> {config.batch_size} to fit (estimated largest: "
                     f"{first.max_batch_size} here, {src_est.max_batch_size} on {trial.hardware_name})")
    if not (est.predicted_samples_per_s and src_est.predicted_samples_per_s):
        raise SpecError("no roofline prediction to scale the measured throughput by")
    ratio = est.predicted_samples_per_s / src_est.predicted_samples_per_s
    what = "this workload" if source.workload_fp == t.fp else f"workload {source.workload_fp[:12]} of the same name"
    where = trial.hardware_name if source.hardware_fp != _hw_fp(hw) else "this hardware"
    reason = (f"transferred: the stored best of {what} on {where} (trial {trial.id}, {trial.samples_per_s:,.1f} "
              f"samples/s measured), throughput scaled by the roofline ratio {ratio:.3g}"
              + "".join(f"; {n}" for n in notes))
    return Recommendation(hardware=name, provenance="transferred", config=config, fits=est.fits,
                          peak_memory_bytes=est.total_bytes, devices=_devices(config), reason=reason,
                          source_trial_id=trial.id, source_hardware=trial.hardware_name,
                          **_throughput_fields(t, trial.samples_per_s * ratio))


def _hw_fp(hw: "HardwareSpec") -> str:
    from advisor.store import hardware_fingerprint

    return hardware_fingerprint(hw)


def _source_target(t: _Target, source: "BestRecord") -> tuple["HardwareSpec", "Workload"]:
    """The hardware the source trial ran on, and its workload (rebuilt from the stored description)."""
    from advisor.hardware.spec import HardwareSpec
    from advisor.workload import load_workload

    spec = t.store.hardware_spec(source.hardware_fp)
    if spec is None:
        raise SpecError(f"hardware {source.hardware_fp[:12]} is not stored")
    hw = HardwareSpec.model_validate(spec)
    if source.workload_fp == t.fp:
        return hw, t.workload
    desc = t.store.workload_description(source.workload_fp) or {}
    if "spec" not in desc:
        raise SpecError(f"workload {source.workload_fp[:12]} was stored without its spec; cannot rebuild it")
    return hw, load_workload(desc["spec"], desc.get("args") or {})


def _batch_cap(t: _Target, config: TrainingConfig) -> int | None:
    """A micro-batch above the dataset's share per process would not make one step (samples)."""
    return max(1, t.epoch // config.nproc) if t.epoch else None


def _estimate(wl: "Workload", hw: "HardwareSpec", c: TrainingConfig) -> "MemoryEstimate":
    """The estimate for `c` on the devices it uses: CPU ranks share the host's memory, so each gets its share."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    update: dict[str, Any] = {"devices_per_node": c.nproc, "nodes": 1}
    if hw.device_type == "cpu" and c.nproc > 1:
        update["host_memory_bytes"] = hw.memory_per_device_bytes // c.nproc
    target = hw.model_copy(update=update)
    request = EstimateRequest.of(c.batch_size, precision=c.precision, optimizer=c.optimizer, strategy=c.strategy,
                                 checkpointing=c.checkpointing, fused_backward=c.fused_backward,
                                 optimizer_impl=c.optimizer_impl)
    return estimate_memory(wl, target, request, EstimateOptions(calibrate=False, compile_mode=c.compile_mode.value))


def _settle(wl: "Workload", hw: "HardwareSpec", config: TrainingConfig,
            est: "MemoryEstimate") -> tuple[TrainingConfig, "MemoryEstimate"]:
    """The largest batch is solved from traces at another batch and can disagree with the estimate
    at the chosen batch (the allocator is simulated only at traced batches): where that estimate
    does not fit, shrink the batch in proportion to the memory over, three times at most."""
    from advisor.transfer import with_batch

    for _ in range(3):
        room = est.usable_bytes - est.runtime_bytes
        if est.fits or room <= 0 or est.total_bytes <= 0:
            break
        smaller = int(config.batch_size * room / est.total_bytes * 0.98)
        if 0 < est.max_batch_size < config.batch_size:
            smaller = min(smaller, est.max_batch_size)
        if smaller < 1:
            break
        config = with_batch(config, smaller)
        est = _estimate(wl, hw, config)
    return config, est


def _estimated(t: _Target, name: str, hw: "HardwareSpec", tried: list[str]) -> Recommendation:
    """A decoder on several GPUs gets the planner's answer; anything else PyTorch's defaults at the largest batch
    that fits on one device (with full activation checkpointing where none fits without it), and a decoder the
    planner's where none fits even so."""
    from advisor.plan.recommend import planned_arch

    planned = hw.device_type == "cuda" and planned_arch(t.workload, t.spec, t.args) is not None
    if planned and hw.world_size > 1:
        return _planned(t, name, tried)
    rec = _defaults(t, name, hw, tried, recompute=not planned)  # the planner weighs checkpointing for a decoder
    return _planned(t, name, tried) if planned and not rec.fits else rec


def _planned(t: _Target, name: str, tried: list[str]) -> Recommendation:
    from advisor.plan.recommend import describe, plans_for, training_config

    result = plans_for(t.workload, name, t.spec, t.args)
    best = result.plans[0]
    nothing = "nothing stored for this workload on this or other hardware" if not tried else "; ".join(tried)
    if not result.fits:
        reason = f"planned: {nothing}; no plan fits: " + "; ".join(result.what_would_fit or ["none found"])
        return Recommendation(hardware=name, provenance="planned", config=training_config(best.config), fits=False,
                              peak_memory_bytes=best.memory_per_device_bytes, devices=best.devices, reason=reason,
                              **_throughput_fields(t, None))
    return Recommendation(hardware=name, provenance="planned", config=training_config(best.config), fits=True,
                          peak_memory_bytes=best.memory_per_device_bytes, devices=best.devices,
                          reason=f"{describe(best, result)}; {nothing}", **_throughput_fields(t, best.samples_per_s))


def _defaults(t: _Target, name: str, hw: "HardwareSpec", tried: list[str], recompute: bool = True) -> Recommendation:
    from advisor.config import Checkpointing
    from advisor.transfer import best_precision, with_batch
    from search_spaces import SpaceContext, baseline

    base = baseline(SpaceContext.for_target(hw, t.workload))
    config = TrainingConfig(**{**base.model_dump(), "precision": best_precision(hw)})
    first = _estimate(t.workload, hw, config)
    recomputed = ""
    if recompute and first.max_batch_size == 0 and not config.checkpointing:  # blocks recomputed in backward
        checkpointed = config.model_copy(update={"checkpointing": Checkpointing.full})
        again = _estimate(t.workload, hw, checkpointed)
        if again.max_batch_size > 0:
            config, first = checkpointed, again
            recomputed = ", activation checkpointing (full) since no batch fits without it,"
    cap = _batch_cap(t, config)
    batch = first.max_batch_size if cap is None else min(first.max_batch_size, cap)
    est = first
    if batch > 0:
        config = with_batch(config, batch)
        est = first if batch == first.request.batch_size else _estimate(t.workload, hw, config)
        config, est = _settle(t.workload, hw, config, est)
    nothing = "nothing stored for this workload on this or other hardware" if not tried else "; ".join(tried)
    whole = cap is not None and batch == cap < first.max_batch_size
    sizing = ("no batch fits, not even 1" if batch == 0 else f"batch {config.batch_size}, "
              + ("the whole dataset per step" if whole else "the largest that fits")
              + f" (estimated largest: {first.max_batch_size})")
    reason = (f"estimated: {nothing}; PyTorch defaults at {config.precision.value}, the fastest precision "
              f"{hw.accelerator.name} supports{recomputed} and {sizing}; throughput from the roofline")
    return Recommendation(hardware=name, provenance="estimated", config=config, fits=batch > 0 and est.fits,
                          peak_memory_bytes=est.total_bytes, devices=_devices(config), reason=reason,
                          **_throughput_fields(t, est.predicted_samples_per_s if batch > 0 else None))
