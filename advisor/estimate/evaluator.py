"""Totals of one estimate request at any batch size: the batch model's trace at b, scaled by the
parallel strategy, with the device's overhead (CPU resident-set model or CUDA allocator), refined
by measured peaks where there are some; and the largest batch that fits under them."""

from __future__ import annotations

from advisor.config import Strategy
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.cuda_alloc import library_workspaces
from advisor.estimate.model import EstimateRequest
from advisor.estimate.overhead import Overhead, cuda_overhead
from advisor.estimate.refine import Refinement
from advisor.estimate.resident.overhead import CpuCalibration, cpu_overhead
from advisor.estimate.resident.terms import mmap_from, resident_terms, touched_peak
from advisor.estimate.strategy import peak_breakdown, scaled_curve
from advisor.estimate.trace import Trace
from advisor.hardware.spec import HardwareSpec

MAX_BATCH_LIMIT = 1 << 22  # samples: the search stops here


class Evaluator:
    """Totals for one (workload, hardware, request) at any batch size."""

    def __init__(self, hw: HardwareSpec, req: EstimateRequest, bm: BatchModel, calib: CpuCalibration | None):
        self.hw, self.req, self.bm, self.calib = hw, req, bm, calib
        # CUDA: measured peaks of req's configuration (refine.py); a CPU's join `calib` instead
        self.refined: Refinement | None = None

    def at(self, b: int, strategy: Strategy | None = None,
           runs: bool = False) -> tuple[Trace, int, dict[str, int], Overhead]:
        """(trace, allocated bytes, breakdown, overhead) at batch b. `runs`: on a CPU, real runs at b itself
        weigh in (CpuCalibration.at_batch); off where a search compares batch sizes, which the line
        alone orders."""
        req = self.req if strategy is None else self.req.model_copy(update={"strategy": strategy})
        tr = self.bm.at(b)
        curve = scaled_curve(req, tr, self.hw.world_size)
        allocated, parts = peak_breakdown(curve)
        if self.hw.device_type == "cpu":
            persistent, heap, over, hidden = self._cpu_terms(curve, tr)
            allocated += hidden  # kernels' own buffers, seen only by real runs: counted as temporaries
            parts["temporaries"] += hidden
            ov = cpu_overhead(allocated, persistent, heap + hidden, self.calib, over,
                              floor=touched_peak(curve, tr.untouched) + hidden, batch=b, runs=runs)
        else:
            workspaces = library_workspaces(self.hw.accelerator.name, tr.cublas_at, tr.cublas_threads)
            ov = cuda_overhead(tr, allocated, workspaces)
            workspace = sum(n for _, n in workspaces)
            allocated += workspace
            parts["temporaries"] += workspace
        return tr, allocated, parts, ov

    def _cpu_terms(self, curve, tr: Trace, mmap_threshold: int | None = None) -> tuple[int, int, int, int]:
        """(persistent peak, heap-served transient bytes over it where they live together, what mapped
        transient allocations add to the persistent peak (terms.resident_terms), kernels' hidden
        buffers) of a CPU curve (bytes): what the resident-set model takes, under glibc's default
        allocator or one whose mmap threshold a run fixed."""
        terms = resident_terms(curve, tr.synthetic, tr.untouched, mmap_from(mmap_threshold))
        persistent, heap, mapped, over, above = terms
        return persistent, above, over, (self.calib.hidden(heap + mapped) if self.calib else 0)

    def transient(self, b: int, mmap_threshold: int | None = None) -> int:
        """CPU: the transient bytes the resident-set slope multiplies at batch b (heap-served ones over
        the persistent peak, plus kernels' hidden buffers, as in `at`), in a run with this glibc mmap
        threshold (None: glibc's default)."""
        tr = self.bm.at(b)
        _, heap, _, hidden = self._cpu_terms(scaled_curve(self.req, tr, self.hw.world_size), tr, mmap_threshold)
        return heap + hidden

    def predicted_total(self, b: int) -> int:
        """The estimator's own total for the request at batch b (bytes), before measured peaks."""
        return self.at(b)[3].total

    def total(self, b: int, strategy: Strategy | None = None, runs: bool = False) -> tuple[int, int]:
        """(total, runtime) at batch b (bytes); measured peaks refine the request's own strategy only.
        runtime: the CUDA context and, over several GPUs, NCCL's buffers (nccl.py). `runs`: as in `at`."""
        from advisor.estimate.nccl import data_parallel_bytes

        _, _, _, ov = self.at(b, strategy, runs)
        runtime = ov.runtime + data_parallel_bytes(self.hw, strategy or self.req.strategy)
        if self.refined is not None and strategy in (None, self.req.strategy):
            return self.refined.total(b, self.predicted_total), runtime
        return ov.total, runtime

    def device_bytes(self, b: int, strategy: Strategy | None = None) -> int:
        return sum(self.total(b, strategy))

    def max_batch(self, usable: int, strategy: Strategy | None = None) -> int:
        """The largest batch whose total fits `usable`, a calibration's margin at that batch kept clear
        (resident.calibration.Calibration.margin: its runs' spread, and their noise at the resident set there)."""
        keep = self.calib is not None and self.refined is None

        def fits(b: int) -> bool:
            total, runtime = self.total(b, strategy)
            return total + runtime + (self.calib.margin(total) if keep else 0) <= usable

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi < MAX_BATCH_LIMIT and fits(hi):
            lo, hi = hi, hi * 2
        if hi >= MAX_BATCH_LIMIT:  # the doubling reached the limit untested: the answer lies up to it
            if fits(MAX_BATCH_LIMIT):
                return MAX_BATCH_LIMIT
            hi = MAX_BATCH_LIMIT
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo
