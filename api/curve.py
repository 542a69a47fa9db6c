"""POST /v1/estimate/curve: an estimate and its per-device memory at several batch sizes, in one isolated
worker call (advisor.estimate.curve), for the web page's Estimate view."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from advisor.estimate.curve import MAX_POINTS, MemoryCurve
from api.routes import WORKLOAD_ERRORS
from api.schemas import EstimateRequest
from api.security import check_workload

v1 = APIRouter(prefix="/v1")


class EstimateCurveRequest(EstimateRequest):
    """POST /v1/estimate's request, and the batch sizes to give the memory at."""

    batch_sizes: list[Annotated[int, Field(gt=0, le=1_000_000)]] | None = Field(
        default=None, min_length=1, max_length=MAX_POINTS, examples=[[1, 2, 4, 8, 16]],
        description=f"Micro-batches per device (samples), at most {MAX_POINTS}; default powers of two from 1 "
                    "through the largest batch that fits, that batch and one past it, and `batch_size`.")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workload": "gpt2-small", "hardware": "h100-sxm", "batch_size": 8, "precision": "bf16"}]})


@v1.post("/estimate/curve", tags=["advice"], responses=WORKLOAD_ERRORS)
def estimate_curve(body: EstimateCurveRequest, request: Request) -> MemoryCurve:
    """POST /v1/estimate's answer (`estimate`), and the per-device memory by part at each of `batch_sizes`
    (`points`): the estimate's own figures at its batch, its batch model's line elsewhere (no more traces)."""
    from advisor.estimate.curve import memory_curve
    from advisor.hardware import check_hardware
    from advisor.isolation import run_isolated

    state = request.app.state.advisor
    check_workload(body.workload, state.settings)
    check_hardware(body.hardware)  # a 422 that takes no worker from the pool
    knobs, options = body.knobs()
    return run_isolated(memory_curve, body.workload, body.hardware, knobs, options, body.batch_sizes,
                        workload_args=body.load_args(), spec=body.workload, what="the estimate",
                        stage=f"loading {body.workload}", timeout_s=state.settings.api_estimate_timeout_s,
                        pool=state.pool)
