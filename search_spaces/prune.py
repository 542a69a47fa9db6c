"""Pruning before running: the memory estimate says whether a configuration can fit (cached per
memory-relevant knobs, so a study traces each case once), and OOMs already seen rule out larger
batches with the same other knobs."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from advisor.errors import EstimateError, SpecError, TrialError, WorkloadFailed
from advisor.hardware.spec import HardwareSpec
from advisor.trial import TrainingConfig, estimate_request, trial_hardware

if TYPE_CHECKING:
    from advisor.workload import Workload

GiB = 2**30
# The knobs the memory estimate depends on; two configs equal on these share one estimate.
MEMORY_KNOBS = ("batch_size", "precision", "optimizer", "strategy", "nproc", "checkpointing", "fused_backward",
                "optimizer_impl", "compile_mode",  # compile_mode: measured peaks refine the estimate per mode
                "tp", "pp", "cp", "pp_schedule", "microbatches", "micro_batch_size", "virtual_stages",
                "sequence_parallel")


class Feasibility(BaseModel):
    """Whether to launch a configuration, and the estimate the decision rests on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launch: bool = Field(description="False: the estimate exceeds usable memory; record the trial as pruned.")
    reason: str = Field(description="One line: predicted against usable, or why there is no estimate.")
    total_bytes: int | None = Field(default=None,
                                    description="Estimated peak per device, without the CUDA context (bytes).")
    runtime_bytes: int | None = Field(default=None, description="CUDA context and library workspaces (bytes).")
    usable_bytes: int | None = Field(default=None, description="Device memory less the margin (bytes).")
    max_batch_size: int | None = Field(default=None, description="Largest batch the estimate fits with these "
                                       "knobs, where the configuration's batch does not fit (samples).")
    _estimate: Any = PrivateAttr(default=None)

    @property
    def estimate(self) -> Any:
        """The MemoryEstimate (one device) or LayoutEstimate (tp/pp) the decision rests on, for the trial to record
        as its prediction instead of estimating again; None where there is none. Not part of the model's dump."""
        return self._estimate

    def resting_on(self, estimate: Any) -> "Feasibility":
        """This decision, holding `estimate`."""
        self._estimate = estimate
        return self


class _Cache:
    """Feasibility by (workload, args, hardware, margin, memory knobs, measured peaks' version); least
    recently used dropped."""

    def __init__(self, size: int = 4096) -> None:
        self.size, self.hits, self.misses = size, 0, 0
        self._data: OrderedDict[tuple, Feasibility] = OrderedDict()

    def get(self, key: tuple) -> Feasibility | None:
        if key in self._data:
            self.hits += 1
            self._data.move_to_end(key)
            return self._data[key]
        self.misses += 1
        return None

    def put(self, key: tuple, value: Feasibility) -> None:
        self._data[key] = value
        if len(self._data) > self.size:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
        self.hits = self.misses = 0


FEASIBILITY_CACHE = _Cache()


def memory_key(config: TrainingConfig) -> tuple:
    dump = config.model_dump(mode="json")
    # a layout's estimate holds the accumulated gradients of grad_accum batches; one device's is of one batch
    accum = (config.grad_accum,) if config.layout().parallel else ()
    return tuple(dump[k] for k in MEMORY_KNOBS) + accum


def _workload_key(workload: "Workload | str") -> Any:
    if isinstance(workload, str):
        return workload
    try:
        hash(workload)
        return workload
    except TypeError:
        return ("object", id(workload))


def feasibility(workload: "Workload | str", workload_args: dict[str, Any] | None, hardware: HardwareSpec,
                config: TrainingConfig, margin: float | None = None, timeout_s: float | None = None) -> Feasibility:
    """Launch or prune `config`: its estimate (calibrate=False: no real runs) against usable memory.

    CPU ranks share the host's memory, so there the estimate counts once per process. A case the
    estimator cannot handle, or a workload that crashes, hangs (past `timeout_s`, default the
    settings') or outgrows its memory cap while traced in its isolated worker, launches: the trial
    measures what it does, and `reason` says why there was no estimate. A tp or pp layout is estimated per
    pipeline rank (advisor.estimate.parallel): its fullest rank against usable memory.
    """
    from advisor.finetune import with_rank
    from advisor.peaks import default_peaks

    workload_args = with_rank(workload_args, config.lora_r)  # the knob's rank builds the adapters
    # a measured peak added since (a trial's, probes/protocol.py) refines the estimate: decide again
    key = (_workload_key(workload), json.dumps(workload_args or {}, sort_keys=True, default=str),
           hardware.model_dump_json(), margin, memory_key(config), default_peaks().version())
    cached = FEASIBILITY_CACHE.get(key)
    if cached is None:
        cached = _decide(workload, workload_args, hardware, config, margin, timeout_s)
        FEASIBILITY_CACHE.put(key, cached)
    return cached


def _decide(workload: "Workload | str", workload_args: dict[str, Any] | None, hardware: HardwareSpec,
            config: TrainingConfig, margin: float | None, timeout_s: float | None) -> Feasibility:
    from advisor import isolation
    from advisor.estimate import EstimateOptions, EstimateRequest

    if config.layout().parallel:
        return _decide_layout(workload, workload_args, hardware, config, margin, timeout_s)
    # The estimate scales by the world size the trial will have, not the whole machine.
    target = trial_hardware(hardware, config)
    request = EstimateRequest.of(config.batch_size, precision=config.precision, optimizer=config.optimizer,
                                 strategy=config.strategy, checkpointing=config.checkpointing,
                                 fused_backward=config.fused_backward, optimizer_impl=config.optimizer_impl)
    # the request's own batch only (one trace, or none where two kept traces of its step give the line): the
    # largest batch is solved only for a batch that does not fit
    options = EstimateOptions(calibrate=False, margin=margin, compile_mode=config.compile_mode.value, largest=False,
                              line=True)

    def estimate(options: EstimateOptions):  # noqa: ANN202 - a MemoryEstimate
        return isolation.estimate(workload, target, request, options, workload_args=workload_args,
                                  timeout_s=timeout_s, reuse=True)  # the trial's runner asks for the same next

    try:
        est = estimate(options)
    except (EstimateError, TrialError, WorkloadFailed) as exc:  # TrialError: the real-step fallback failed too
        return Feasibility(launch=True, reason=f"no estimate ({exc}); launching to measure")
    sharing = config.nproc if hardware.device_type == "cpu" else 1
    need = (est.total_bytes + est.runtime_bytes) * sharing
    launch = need <= est.usable_bytes
    ranks = f" x {sharing} ranks on one host" if sharing > 1 else ""
    if launch:
        reason = f"fits: {need / GiB:.2f} GiB predicted{ranks} of {est.usable_bytes / GiB:.2f} GiB usable"
    else:
        try:  # the decision stands on the first answer
            max_batch = estimate(options.model_copy(update={"largest": True, "exact_largest": False})).max_batch_size
        except (EstimateError, TrialError, WorkloadFailed) as exc:
            max_batch, largest = None, f"largest batch not estimated ({exc})"
        if max_batch is not None:
            largest = f"largest batch that fits: {max_batch}" if max_batch else "no batch fits"
        reason = (f"predicted {need / GiB:.2f} GiB{ranks} exceeds {est.usable_bytes / GiB:.2f} GiB usable "
                  f"({est.device_memory_bytes / GiB:.2f} GiB less the margin); {largest}")
    return Feasibility(launch=launch, reason=reason, total_bytes=est.total_bytes, runtime_bytes=est.runtime_bytes,
                       usable_bytes=est.usable_bytes, max_batch_size=None if launch else max_batch).resting_on(est)


def _decide_layout(workload: "Workload | str", workload_args: dict[str, Any] | None, hardware: HardwareSpec,
                   config: TrainingConfig, margin: float | None, timeout_s: float | None) -> Feasibility:
    """`_decide` for a tp/pp layout: the per-pipeline-rank estimate (advisor.estimate.parallel), its peak rank
    against usable memory; on a CPU every rank against the one host's."""
    from advisor import isolation
    from advisor.estimate.parallel import estimate_layout

    layout, request = config.layout(), estimate_request(config)
    target = trial_hardware(hardware, config)
    try:
        if isinstance(workload, str):
            est = isolation.estimate_layout(workload, target, layout, request, workload_args=workload_args,
                                            margin=margin, grad_accum=config.grad_accum, timeout_s=timeout_s)
        else:  # the caller's own object, estimated in the caller's process (as isolation.estimate does)
            est = estimate_layout(workload, target, layout, request, workload_args=workload_args, margin=margin,
                                  grad_accum=config.grad_accum)
    except (EstimateError, SpecError, TrialError, WorkloadFailed) as exc:
        return Feasibility(launch=True, reason=f"no estimate of {layout.label()} ({exc}); launching to measure")
    peak = est.peak
    if hardware.device_type == "cpu":  # the ranks share the host's memory
        need = sum((r.total_bytes + est.runtime_bytes) * len(r.ranks) for r in est.ranks)
        where = f"its {layout.world} ranks on one host"
    else:
        need = peak.total_bytes + est.runtime_bytes
        where = f"pipeline rank {peak.stages[0]} (ranks {', '.join(map(str, peak.ranks))}; the fullest)"
    launch = need <= est.usable_bytes
    if launch:
        reason = f"fits: {need / GiB:.2f} GiB predicted on {where} of {est.usable_bytes / GiB:.2f} GiB usable"
    else:
        reason = (f"predicted {need / GiB:.2f} GiB on {where} exceeds {est.usable_bytes / GiB:.2f} GiB usable "
                  f"({est.device_memory_bytes / GiB:.2f} GiB less the margin)")
    return Feasibility(launch=launch, reason=f"{reason}; layout {layout.label()}", total_bytes=peak.total_bytes,
                       runtime_bytes=est.runtime_bytes, usable_bytes=est.usable_bytes).resting_on(est)


class OomFrontier:
    """Configurations known not to fit, from OOMs already measured.

    After an OOM at batch b (and grad_accum a), the same other knobs at batch >= b and
    grad_accum >= a cannot fit either: a larger micro-batch holds more activations, and
    accumulating keeps gradients alive through the next micro-batch's forward.
    """

    def __init__(self) -> None:
        self._ooms: dict[tuple, list[tuple[int, int]]] = {}

    @staticmethod
    def _key(config: TrainingConfig) -> tuple:
        dump = config.model_dump(mode="json")
        return tuple((k, v) for k, v in sorted(dump.items()) if k not in ("batch_size", "grad_accum"))

    def record_oom(self, config: TrainingConfig) -> None:
        """Remember that `config` ran out of memory."""
        self._ooms.setdefault(self._key(config), []).append((config.batch_size, config.grad_accum))

    def blocks(self, config: TrainingConfig) -> str | None:
        """Why `config` cannot fit (one line), or None when no recorded OOM rules it out."""
        for batch, accum in self._ooms.get(self._key(config), []):
            if config.batch_size >= batch and config.grad_accum >= accum:
                return (f"batch {config.batch_size} >= {batch}, which ran out of memory with the same other knobs"
                        + (f" (grad_accum {accum})" if accum > 1 else ""))
        return None

    def __len__(self) -> int:
        return sum(len(v) for v in self._ooms.values())
