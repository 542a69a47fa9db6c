"""What crosses the HTTP boundary: request bodies and responses of /v1, with examples for OpenAPI.

Stored records (advisor.store.records) stay internal; these are their public shapes. Every model
forbids unknown fields, so a misspelt knob is a 422 naming it rather than a silent default.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from advisor.config import CHECKPOINTING_DOC, Checkpointing, OptimizerKind, Precision, Strategy
from advisor.finetune import FineTune, with_finetune
from advisor.parallel.layout import PipelineSchedule
from advisor.plan.knobs import FIX_KEYS, FixedKnobs
from advisor.plan.model import Objective
from advisor.recommend import Recommendation
from advisor.store.records import JOB_STATUSES
from advisor.tune.request import Sampler

T = TypeVar("T")
MAX_ARGS = 32  # workload_args entries
MAX_ARG_KEY = 64  # characters of a workload_args key
MAX_ARG_STR = 256  # characters of a workload_args string value
ARG_KEY = r"^[A-Za-z_][A-Za-z0-9_]*$"
_ARG_KEY = re.compile(ARG_KEY)
MAX_CANDIDATES = 16  # hardware candidates in one recommend
MAX_PAGE = 500  # rows in one page
# What one POST /v1/plan may ask for: the planner's work grows with the targets (hardware x node counts), their
# devices (the meshes to try) and the plans kept; the isolated worker's time limit (ADVISOR_API_ESTIMATE_TIMEOUT_S)
# ends whatever these still allow past it.
MAX_PLAN_HARDWARE = 4  # hardware specs
MAX_PLAN_NODES = 128  # the largest node count of a range
MAX_PLAN_TARGETS = 16  # hardware specs x node counts
MAX_PLAN_DEVICES = 1024  # devices of one target
MAX_PLAN_TOP = 20  # plans returned
MAX_GLOBAL_BATCH = 1 << 20  # samples per optimizer step
_PLAN_HW = re.compile(r"^([a-z0-9][a-z0-9._-]*)(?::(\d{1,6})(?:x(\d{1,6}))?)?$")

JobStatus = Literal[JOB_STATUSES]  # type: ignore[valid-type]  # the store's, one list


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_args(v: dict[str, Any]) -> dict[str, Any]:
    if len(v) > MAX_ARGS:
        raise ValueError(f"at most {MAX_ARGS} entries")
    for key in v:
        if not key.isidentifier():
            raise ValueError(f"key {key[:MAX_ARG_KEY]!r} is not a Python identifier")
    return v


def _check_scalar_args(v: Any) -> Any:
    """workload_args: at most MAX_ARGS identifier keys, each a JSON scalar (a short string, a finite number, a
    boolean or null). Checked before the types, so the message names the key and the limit."""
    if not isinstance(v, dict):
        return v  # the type's own message
    if len(v) > MAX_ARGS:
        raise ValueError(f"at most {MAX_ARGS} entries, not {len(v)}")
    for key, value in v.items():
        name = repr(key[:MAX_ARG_KEY]) + ("..." if len(key) > MAX_ARG_KEY else "")
        if len(key) > MAX_ARG_KEY or not _ARG_KEY.match(key):
            raise ValueError(f"key {name} is not an identifier of at most {MAX_ARG_KEY} characters")
        if isinstance(value, str) and len(value) > MAX_ARG_STR:
            raise ValueError(f"{name} is a string of {len(value)} characters; at most {MAX_ARG_STR}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} is not a finite number")
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise ValueError(f"{name} is out of the 64-bit integer range")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"{name} is a {type(value).__name__}; give a string, number, boolean or null")
    return v


ArgKey = Annotated[str, StringConstraints(max_length=MAX_ARG_KEY, pattern=ARG_KEY)]
ArgValue = (Annotated[str, StringConstraints(max_length=MAX_ARG_STR)] | bool
            | Annotated[int, Field(ge=-2**63, le=2**63 - 1)] | Annotated[float, Field(allow_inf_nan=False)] | None)


class WorkloadRef(_In):
    workload: str = Field(min_length=1, max_length=200, description="A built-in preset (GET /v1/workloads), or "
                          "`pkg.module:build` inside the server's ADVISOR_WORKLOAD_MODULES.",
                          examples=["tiny-gpt2"])
    workload_args: dict[ArgKey, ArgValue] = Field(
        default_factory=dict, max_length=MAX_ARGS, examples=[{"seq_len": 128}],
        description=f"Keyword arguments for the workload's build: at most {MAX_ARGS}, each an identifier of at most "
                    f"{MAX_ARG_KEY} characters with a JSON scalar value (a string of at most {MAX_ARG_STR} "
                    "characters, a finite number, a boolean or null).")

    _args = field_validator("workload_args", mode="before")(_check_scalar_args)


class FineTuned(WorkloadRef):
    """A workload reference that may fine-tune the workload: frozen modules, LoRA adapters (advisor/finetune.py)."""

    finetune: FineTune | None = Field(
        default=None, description="What of the model trains: `freeze` (module-name patterns, fnmatch) and `lora` "
        "(adapters on a frozen base: r, alpha, dropout, targets as peft's target_modules). A pattern or targets "
        "that match no module are a 422.", examples=[{"lora": {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}}])

    def load_args(self) -> dict[str, Any]:
        """workload_args with the fine-tune: what advisor.workload.load_workload builds the workload from."""
        return with_finetune(self.workload_args, self.finetune)


class EstimateRequest(FineTuned):
    hardware: str = Field(min_length=1, max_length=100, description="Catalog name[:devices[xnodes]] or 'cpu'.",
                          examples=["h100-sxm"])
    batch_size: int | None = Field(default=None, gt=0, le=1_000_000,
                                   description="Micro-batch per device; default the workload's.")
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    strategy: Strategy = Strategy.single
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = None
    checkpointing: Checkpointing = Field(default=Checkpointing.none, description=CHECKPOINTING_DOC)
    fused_backward: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    margin: float | None = Field(default=None, ge=0, lt=1, description="Fraction of device memory kept free.")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "gpt2-small", "hardware": "h100-sxm", "batch_size": 8, "precision": "bf16"}]})

    def knobs(self) -> Any:
        """The estimator's request and options for this body (advisor.estimate's EstimateRequest, EstimateOptions):
        a request calibrates nothing, using a CPU calibration kept on the host where there is one."""
        import advisor.estimate as estimator

        knobs = estimator.EstimateRequest.of(self.batch_size, precision=self.precision, optimizer=self.optimizer,
                                             strategy=self.strategy, checkpointing=self.checkpointing,
                                             fused_backward=self.fused_backward,
                                             offload_optimizer=self.offload_optimizer,
                                             offload_params=self.offload_params, optimizer_impl=self.optimizer_impl)
        return knobs, estimator.EstimateOptions(calibrate="kept", margin=self.margin)


class LayoutEstimateRequest(WorkloadRef):
    """An estimate of a parallel layout: tp x pp x cp ranks, data parallel over the rest of the hardware's devices."""

    hardware: str = Field(min_length=1, max_length=100, description="Catalog name[:devices[xnodes]] or 'cpu:N'.",
                          examples=["h100-sxm:16"])
    tp: int = Field(default=1, ge=1, le=1024, description="Tensor-parallel ranks.")
    pp: int = Field(default=1, ge=1, le=1024, description="Pipeline-parallel ranks.")
    cp: int = Field(default=1, ge=1, le=1024, description="Context-parallel ranks (sequences split, ring attention).")
    dp_replicate: int = Field(default=1, ge=1, le=100_000, description="HSDP: data-parallel groups, each sharding "
                              "the model within itself; 1: plain ZeRO over every data-parallel rank.")
    strategy: Strategy = Field(default=Strategy.single, description="The data-parallel part (over the other devices).")
    schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    microbatches: int | None = Field(default=None, ge=1, le=100_000)
    virtual_stages: int = Field(default=1, ge=1, le=64)
    sequence_parallel: bool = True
    batch_size: int | None = Field(default=None, gt=0, le=1_000_000,
                                   description="Samples per data-parallel replica per step; default the workload's.")
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = None
    checkpointing: Checkpointing = Field(default=Checkpointing.none, description=CHECKPOINTING_DOC)
    offload_optimizer: bool = Field(default=False, description="Optimizer state and step on the host (ZeRO-Offload).")
    offload_params: bool = Field(default=False, description="Sharded parameters, and their reduced gradients, on the "
                                 "host (strategy zero3 over several data-parallel ranks).")
    grad_accum: int = Field(default=1, ge=1, le=100_000, description="Batches whose gradients each optimizer step "
                            "accumulates.")
    margin: float | None = Field(default=None, ge=0, lt=1, description="Fraction of device memory kept free.")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "llama-8b", "hardware": "h100-sxm:16", "tp": 4, "pp": 2, "strategy": "zero3", "batch_size": 8,
         "precision": "bf16"}]})


class RecommendRequest(FineTuned):
    hardware: list[str] | str = Field(description="One candidate or several: catalog name[:devices].",
                                      examples=[["a100-80gb", "h100-sxm", "l4"]])
    prices: dict[str, float] | None = Field(default=None, description="USD per device-hour, keyed as in `hardware`; "
                                            "ranks by cost per epoch.", examples=[{"a100-80gb": 1.8, "h100-sxm": 3.2}])

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "gpt2-small", "hardware": ["a100-80gb", "h100-sxm", "l4"],
         "prices": {"a100-80gb": 1.8, "h100-sxm": 3.2, "l4": 0.7}}]})

    @field_validator("hardware")
    @classmethod
    def _few(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and not 1 <= len(v) <= MAX_CANDIDATES:
            raise ValueError(f"give 1 to {MAX_CANDIDATES} hardware candidates")
        return v


class PlanRequest(FineTuned):
    """What POST /v1/plan plans: `advisor plan`'s options (a decoder workload on GPU targets), fine-tuned or not
    (a fine-tune is planned data parallel only: tp, pp, cp or dp_replicate held above 1 with it is a 422)."""

    workload: str = Field(min_length=1, max_length=200, description="A decoder preset (GET /v1/workloads: "
                          "llama-*, gpt2-*, decoder, ...), or `pkg.module:build` inside the server's "
                          "ADVISOR_WORKLOAD_MODULES, described in an isolated worker.", examples=["llama-8b"])
    hardware: list[Annotated[str, StringConstraints(min_length=1, max_length=100)]] = Field(
        min_length=1, max_length=MAX_PLAN_HARDWARE, examples=[["h100-sxm:8"]],
        description=f"1 to {MAX_PLAN_HARDWARE} GPU targets, catalog NAME:N (N devices on one node) or NAME:NxM (M "
                    f"nodes), at most {MAX_PLAN_DEVICES} devices each; with `nodes`, NAME:N gives the devices per "
                    "node.")
    nodes: tuple[Annotated[int, Field(ge=1, le=MAX_PLAN_NODES)], Annotated[int, Field(ge=1, le=MAX_PLAN_NODES)]] \
        | None = Field(default=None, examples=[[1, 4]], description=f"[FIRST, LAST]: plan each node count from FIRST "
                       f"to LAST (inclusive) and rank them together; LAST at most {MAX_PLAN_NODES}, hardware x node "
                       f"counts at most {MAX_PLAN_TARGETS}.")
    global_batch_size: int | None = Field(default=None, ge=1, le=MAX_GLOBAL_BATCH, description="Samples per "
                                          "optimizer step; default about a million tokens' worth, a power of 2.")
    fix: FixedKnobs = Field(default_factory=FixedKnobs, examples=[{"tp": 2}], description="Knobs held at one value, "
                            f"as `--fix KEY=VALUE`: {', '.join(FIX_KEYS)}.")
    prices: dict[Annotated[str, StringConstraints(max_length=100)], Annotated[float, Field(ge=0, le=1e6)]] = Field(
        default_factory=dict, max_length=MAX_PLAN_HARDWARE, examples=[{"h100-sxm": 3.2}],
        description="USD per device-hour by catalog name; with a price for every target, plans rank by cost per "
                    "million tokens.")
    objective: Objective | None = Field(default=None, description="What ranks the plans; default cost where every "
                                        "target is priced, else tokens/s per device.")
    top: int = Field(default=5, ge=1, le=MAX_PLAN_TOP, description="Plans to return.")
    margin: float | None = Field(default=None, ge=0, lt=1, description="Fraction of device memory kept free.")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "llama-8b", "hardware": ["h100-sxm:8"], "fix": {"tp": 2}, "top": 3}]})

    @field_validator("fix", mode="before")
    @classmethod
    def _known_knobs(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in v:
                if key not in FIX_KEYS:
                    raise ValueError(f"unknown knob {str(key)[:MAX_ARG_KEY]!r}; knobs: {', '.join(FIX_KEYS)}")
        return v

    @field_validator("hardware")
    @classmethod
    def _bounded_targets(cls, v: list[str]) -> list[str]:
        for spec in v:
            m = _PLAN_HW.match(spec.strip().lower())
            devices = int(m.group(2) or 1) * int(m.group(3) or 1) if m else 0
            if devices > MAX_PLAN_DEVICES:
                raise ValueError(f"{spec[:100]!r} has {devices} devices; plan at most {MAX_PLAN_DEVICES} devices "
                                 "a target over the API")
        return v

    @field_validator("nodes", mode="before")
    @classmethod
    def _node_range(cls, v: Any) -> Any:
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(type(n) is int for n in v)):
            return v  # the type's own message
        allowed = f"give [FIRST, LAST] with 1 <= FIRST <= LAST <= {MAX_PLAN_NODES}"
        if not 1 <= v[0] <= v[1]:
            raise ValueError(f"[{v[0]}, {v[1]}] has no node count; {allowed}")
        if v[1] > MAX_PLAN_NODES:
            raise ValueError(f"[{v[0]}, {v[1]}] goes past {MAX_PLAN_NODES} nodes; {allowed}")
        return v

    @model_validator(mode="after")
    def _few_targets(self) -> "PlanRequest":
        counts = 1 if self.nodes is None else self.nodes[1] - self.nodes[0] + 1
        if counts * len(self.hardware) > MAX_PLAN_TARGETS:
            raise ValueError(f"{len(self.hardware)} hardware x {counts} node counts is {counts * len(self.hardware)} "
                             f"targets; plan at most {MAX_PLAN_TARGETS} in one request")
        if self.nodes is not None:
            worst = max(self.hardware, key=lambda spec: _per_node(spec))
            if _per_node(worst) * self.nodes[1] > MAX_PLAN_DEVICES:
                raise ValueError(f"{worst[:100]!r} on {self.nodes[1]} nodes is {_per_node(worst) * self.nodes[1]} "
                                 f"devices; plan at most {MAX_PLAN_DEVICES} devices a target over the API")
        return self


def _per_node(spec: str) -> int:
    m = _PLAN_HW.match(spec.strip().lower())
    return int(m.group(2) or 1) if m else 1


class RecommendResponse(_Out):
    workload: str
    recommendations: list[Recommendation] = Field(description="Best first: fitting, then cost or time per epoch.")


class TuneJobRequest(FineTuned):
    """What POST /v1/tune queues: `advisor tune`'s options (same names, same defaults)."""

    hardware: str = Field(default="local", max_length=100, description="Where the trials run: 'local', 'cpu' or a "
                          "catalog spec of the worker's devices.", examples=["cpu"])
    space: str = Field(default="quick", max_length=64, pattern=r"^[A-Za-z0-9_-]+$",
                       description="A search-space preset name (files are not accepted over the API).")
    fixes: dict[str, Any] = Field(default_factory=dict, description="Knobs held at one value.",
                                  examples=[{"precision": "bf16"}])
    objective: Literal["throughput", "throughput,memory"] = "throughput"
    global_batch_size: int | None = Field(default=None, gt=0)
    sampler: Sampler | None = None
    trials: int = Field(default=20, gt=0, le=1000,
                        description="Distinct configurations in the study, baseline included.")
    time_budget_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    patience: int | None = Field(default=None, gt=0)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    remeasure: bool = False
    confirm: int | None = Field(default=None, ge=0, le=1000, description="Trials of the budget kept to measure the "
                                "leading configurations again (default: trials // 8).")
    min_time_s: float = Field(default=2.0, gt=0, le=600, description="Seconds each trial is timed at least.")
    trial_timeout_s: float = Field(default=300.0, gt=0, le=86400, description="A trial is killed after this long.")
    settle_s: float = Field(default=5.0, ge=0, le=600, description="Seconds each trial waits at most for the machine "
                            "to go quiet before it starts (0: at once, without looking; where it is still busy after "
                            "the wait, the trial's notes say so).")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "tiny-gpt2", "workload_args": {"seq_len": 128}, "hardware": "cpu", "space": "quick", "trials": 6,
         "min_time_s": 1}]})

    _fixes = field_validator("fixes")(_check_args)


class BestSoFar(_Out):
    trial_id: int
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    config: dict[str, Any]


class Progress(_Out):
    done: int = Field(description="Trials of this job's study finished (any status but running).")
    total: int = Field(description="The study's trial budget.")
    fraction: float = Field(ge=0, le=1)


class Job(_Out):
    id: str
    status: JobStatus
    request: dict[str, Any] = Field(description="The TuneJobRequest as submitted.")
    study_id: int | None = None
    study_name: str | None = None
    progress: Progress
    best: BestSoFar | None = None
    error: str | None = None
    worker: str | None = Field(default=None, description="host:pid of the process running it.")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class JobAccepted(_Out):
    job_id: str
    status: JobStatus
    href: str = Field(description="Where to poll: GET /v1/jobs/{id}.")


class Trial(_Out):
    id: int
    study_id: int
    study_name: str
    workload_name: str
    workload_fp: str
    hardware_name: str
    hardware_fp: str
    config: dict[str, Any] = Field(description="The TrainingConfig measured.")
    config_hash: str
    attempt: int
    status: str = Field(description="ok, oom, timeout, crashed, error, invalid, pruned, interrupted or running.")
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_p50_s: float | None = None
    step_p90_s: float | None = None
    peak_memory_bytes: int | None = None
    predicted_memory_bytes: int | None = None
    data_wait_fraction: float | None = None
    mfu: float | None = None
    bottleneck: str | None = None
    error: str | None = None
    started_at: datetime
    finished_at: datetime | None = None


class Study(_Out):
    id: int
    name: str
    workload_name: str
    workload_fp: str
    hardware_name: str
    hardware_fp: str
    status: Literal["running", "finished", "failed"]
    objective: str = Field(description="e.g. samples_per_s:maximize")
    created_at: datetime
    finished_at: datetime | None = None
    trial_counts: dict[str, int] = Field(description="Trials by status.")
    best: Trial | None = Field(default=None, description="The best ok trial by the objective's first metric.")
    space: dict[str, Any] | None = Field(default=None, description="The search space (GET /v1/studies/{id} only).")


class Page(_Out, Generic[T]):
    items: list[T]
    total: int = Field(description="Rows matching the filters, all pages.")
    limit: int
    offset: int


class HardwareItem(_Out):
    name: str
    spec: dict[str, Any]


class WorkloadItem(_Out):
    name: str
    parameters: dict[str, Any] = Field(description="Keyword arguments its build takes, with defaults.")
    description: str | None = None


class ErrorBody(_Out):
    detail: str = Field(description="What was wrong and what is allowed.")
