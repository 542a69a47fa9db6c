"""Per-device memory and collective bytes of a parallel layout (dp x tp x pp): each pipeline rank's program traced
on fake tensors under a fake process group (rank_trace.py), the tensor-parallel ranks and data-parallel replicas of
a stage being alike. On a CUDA target the trace is replayed through the caching-allocator model, and the CUDA
context is added, as for one device (overhead.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from advisor.config import Strategy
from advisor.errors import SpecError
from advisor.estimate.model import Breakdown, EstimateRequest
from advisor.parallel.layout import Layout, layout_problems


class RankEstimate(BaseModel):
    """What one pipeline rank's devices hold at their peak: every rank with these pipeline stages alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ranks: list[int] = Field(description="The global ranks this figure is for (one pipeline rank's tp x dp).")
    stages: list[int] = Field(description="Pipeline stages these ranks hold (first stage 0).")
    layers: int = Field(description="Decoder layers on these ranks (0 for a model that is not a decoder).")
    total_bytes: int = Field(description="Predicted peak of the quantity the estimate's `predicts` names (bytes).")
    allocated_bytes: int = Field(description="Predicted peak of live tensor bytes (bytes).")
    breakdown: Breakdown
    comm_bytes: dict[str, int] = Field(description="Collective payload bytes per optimizer step, by kind "
                                       "(advisor/parallel/comm.py).")
    fits: bool
    nccl_bytes: int = Field(default=0, description="NCCL's communicator buffers on each of these GPUs, outside the "
                            "allocator and beside the CUDA context (advisor/estimate/nccl.py; 0 on a CPU) (bytes).")
    host_bytes: int = Field(default=0, description="Host memory each of these ranks keeps under ZeRO-Offload: the "
                            "optimizer state, and the parameters and gradients (its shards under ZeRO) the host's "
                            "step reads and writes; 0 without offload (bytes).")


class LayoutEstimate(BaseModel):
    """The estimator's answer for a parallel layout: one RankEstimate per pipeline rank (two where gloo's scatter
    stages a copy on the tensor-parallel root alone)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    hardware: str
    layout: Layout
    request: EstimateRequest
    grad_accum: int = Field(default=1, description="Batches whose gradients each optimizer step accumulates.")
    predicts: Literal["cpu_allocated", "cuda_reserved"] = Field(
        description="What total_bytes predicts: live tensor bytes on a CPU rank, max_memory_reserved on a GPU.")
    ranks: list[RankEstimate]
    device_memory_bytes: int
    usable_bytes: int
    fits: bool = Field(description="Every rank fits.")
    runtime_bytes: int = Field(default=0, description="CUDA context per device, outside the allocator (bytes).")
    method: Literal["traced", "analytic"] = Field(default="traced", description="How each rank's figures were "
                                                  "obtained: its program traced, or decoder formulas "
                                                  "(parallel_analytic.py).")
    num_params: int = Field(description="Parameters of the whole model.")
    notes: list[str] = Field(default_factory=list)
    seconds: float

    def for_rank(self, rank: int) -> RankEstimate:
        return next(r for r in self.ranks if rank in r.ranks)

    @property
    def peak(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.total_bytes)


def check_layout(workload: Any, hardware: Any, layout: Layout, batch_size: int, model: Any = None) -> None:
    """SpecError with the first problem of `layout` for this workload on this hardware's devices (one line).
    `model`: the workload's model built on the meta device, where the caller has it (else built here if needed)."""
    problems = layout_problems(layout, world=hardware.world_size, decoder=workload.decoder,
                               model_name=workload.name, batch_size=batch_size)
    if problems:
        raise SpecError(problems[0])
    if layout.tp > 1 and workload.decoder is None:
        from advisor.parallel.tensor import is_decoder, pair_plan

        model = model if model is not None else _meta_model(workload)
        if not is_decoder(model):
            try:
                pair_plan(model)
            except ValueError as exc:
                raise SpecError(f"tp {layout.tp}: {exc}") from None


def _meta_model(workload: Any) -> Any:
    import torch

    with torch.device("meta"):
        return workload.build_model()


def estimate_layout(workload: Any, hardware: Any, layout: Layout, request: EstimateRequest | None = None, *,
                    workload_args: dict[str, Any] | None = None, margin: float | None = None,
                    method: Literal["traced", "analytic", "auto"] = "auto", grad_accum: int = 1) -> LayoutEstimate:
    """Per-device memory of `layout` for `workload` on `hardware` (catalog name[:devices] or a HardwareSpec; its
    device count is the layout's world), at `request` (batch_size: samples per data-parallel replica per step;
    offload_optimizer, offload_params: offload.py), each optimizer step accumulating the gradients of `grad_accum`
    such batches (the peak: its last, the gradients already held; collectives per optimizer step).
    `method`: "traced" (each pipeline rank's program on fake tensors), "analytic" (decoder formulas), "auto"
    (`layout_method`). Raises SpecError where the layout cannot run this workload there (or "analytic" is asked of
    a model that is not a decoder), EstimateError where it cannot be traced."""
    from advisor.estimate.estimator import _local_cpu, _margin, _resolve
    from advisor.estimate.model import EstimateOptions
    from advisor.estimate.nccl import layout_bytes
    from advisor.estimate.offload import offload_problem, offloads
    from advisor.estimate.rank_trace import trace_rank

    t0 = time.perf_counter()
    wl, hw = _resolve(workload, hardware, workload_args)
    req = request or EstimateRequest()
    if req.batch_size is None:
        req = req.model_copy(update={"batch_size": wl.default_batch_size})
    req = req.model_copy(update={"strategy": layout.strategy})
    meta = _meta_model(wl) if wl.decoder is None else None  # a decoder's shape says what the checks need
    check_layout(wl, hw, layout, req.batch_size, meta)
    why = offload_problem(layout, req) or (f"grad_accum must be 1 or more, not {grad_accum}" if grad_accum < 1 else "")
    if why:
        raise SpecError(why)
    usable = int(hw.memory_per_device_bytes * (1 - _margin(EstimateOptions(margin=margin))))
    cuda = hw.device_type == "cuda"
    split = layout.split(wl.decoder.layers) if wl.decoder is not None else ()
    ranks, notes, runtime = [], [], 0
    method = layout_method(wl, layout, method)
    rt = None
    for pp_rank in range(layout.pp):
        rank = pp_rank * (layout.world // layout.pp)  # dp 0, cp 0, tp 0 of this pipeline rank
        if method == "analytic":
            from advisor.estimate.parallel_analytic import analytic_rank_trace

            trace, comm = analytic_rank_trace(wl.decoder, layout, pp_rank, req, device_type=hw.device_type,
                                              optimizer_impl=_impl(req, hw.device_type), grad_accum=grad_accum)
        else:
            rt = trace_rank(wl, layout, rank, req.batch_size, precision=req.precision, optimizer=req.optimizer,
                            optimizer_impl=_impl(req, hw.device_type), checkpointing=req.checkpointing,
                            cpu_workspaces=_local_cpu(hw), gloo=not cuda, grad_accum=grad_accum)
            trace, comm = rt.trace, rt.comm_bytes
        members = [r for r in range(layout.world) if layout.coords(r)["pp"] == pp_rank]
        # gloo's scatter stages a flat copy on its root (tp 0) only: the stage's other tp ranks get the peers' trace
        groups = [(members, trace)] if rt is None or rt.peer_trace is None else [
            ([r for r in members if layout.coords(r)["tp"] == 0], trace),
            ([r for r in members if layout.coords(r)["tp"] != 0], rt.peer_trace)]
        stages = [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]
        layers = sum(split[s] for s in stages) if split else 0
        nccl = layout_bytes(hw, layout, pp_rank) if cuda else 0
        for group, group_trace in groups:
            estimate, runtime = _rank_estimate(group_trace, req, cuda, usable, ranks=group, stages=stages,
                                               layers=layers, comm_bytes=comm, nccl_bytes=nccl)
            ranks.append(estimate)
    num_params = _param_count(wl, meta)
    if cuda:
        notes.append("nccl_bytes: NCCL's communicator buffers, modelled from its default buffer sizes and channel "
                     "counts (advisor/estimate/nccl.py)")
    if method == "analytic":
        notes.append("analytic: per-layer decoder formulas (Korthikanti et al. 2022) at the schedule's moments")
    if offloads(req):
        notes.append("offload: the optimizer state and step on the host" + (", and the parameter shards and reduced "
                     "gradients" if req.offload_params else "") + "; host_bytes: each rank's host memory")
    return LayoutEstimate(workload=wl.name, hardware=hw.accelerator.name, layout=layout, request=req, method=method,
                          grad_accum=grad_accum,
                          predicts="cuda_reserved" if cuda else "cpu_allocated", ranks=ranks,
                          device_memory_bytes=hw.memory_per_device_bytes, usable_bytes=usable,
                          fits=all(r.fits for r in ranks), runtime_bytes=runtime if cuda else 0,
                          num_params=num_params, notes=notes, seconds=time.perf_counter() - t0)


def _rank_estimate(trace: Any, req: EstimateRequest, cuda: bool, usable: int,
                   **fields: Any) -> tuple[RankEstimate, int]:
    """(The RankEstimate of the ranks whose peak `trace` is, the CUDA context's bytes (0 on a CPU)); `fields`:
    RankEstimate's ranks, stages, layers, comm_bytes and nccl_bytes."""
    from advisor.estimate.offload import host_bytes, on_device
    from advisor.estimate.strategy import peak_breakdown

    host, trace = host_bytes(trace, req), on_device(trace, req)
    allocated, parts = peak_breakdown(trace.curve)
    total, runtime = allocated, 0
    if cuda:
        from advisor.estimate.overhead import cuda_overhead

        ov = cuda_overhead(trace, allocated)
        total, allocated, runtime = ov.total, ov.allocated, ov.runtime
    parts["overhead"] = max(total - sum(parts.values()), 0)
    outside = runtime + fields.get("nccl_bytes", 0)
    return RankEstimate(total_bytes=total, allocated_bytes=allocated, breakdown=Breakdown(**parts),
                        fits=total + outside <= usable, host_bytes=host, **fields), runtime


def layout_method(wl: Any, layout: Layout, method: str) -> Literal["traced", "analytic"]:
    """The method `estimate_layout` uses. "auto": analytic for a decoder whose parameters per pipeline and
    tensor-parallel rank, params / (tp x pp), exceed settings.trace_param_limit / 8, traced otherwise: the limit
    bounds one device's trace, and a rank's costs more per parameter (DTensor and the schedule add work to every
    op) and runs once per pipeline rank. SpecError for "analytic" without a decoder."""
    if layout.strategy in (Strategy.ddp, Strategy.zero1) and layout.grad_ranks > 1:
        # DDP's reducer (zero1's too) reads its gradients' memory as it is built: a fake tensor has none to read
        if method == "traced" or wl.decoder is None:
            raise SpecError(f"a layout with {layout.strategy.value} replicas cannot be traced (DDP reads its "
                            "gradients' memory as it is built); use --method analytic or auto, or zero2 / zero3 "
                            "for the replicas")
        return "analytic"
    if method == "traced":
        return "traced"
    if wl.decoder is None:
        if method == "analytic":
            raise SpecError(f"the analytic method covers decoder presets only; {wl.name} is not one: use "
                            "--method traced or auto")
        return "traced"
    if method == "analytic":
        return "analytic"
    from advisor.estimate.analytic import decoder_param_count
    from advisor.settings import get_settings

    per_rank = decoder_param_count(wl.decoder) / (layout.tp * layout.pp)
    return "analytic" if per_rank > get_settings().trace_param_limit / 8 else "traced"


def _impl(req: EstimateRequest, device_type: str) -> str | None:
    from advisor.estimate.estimator import _trace_impl

    return _trace_impl(req, device_type)


def _param_count(wl: Any, meta: Any) -> int:
    """The whole model's parameters: a decoder's from its shape, any other's from its meta-device build."""
    if wl.decoder is not None:
        from advisor.estimate.analytic import decoder_param_count

        return decoder_param_count(wl.decoder)
    return sum(p.numel() for p in meta.parameters())
