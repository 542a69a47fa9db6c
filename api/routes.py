"""The routes. Each calls the service function the CLI calls: `estimate_memory`, `recommend`, `plan`, the
store's queries, the job queue. Work that loads a workload runs in an isolated worker of the app's
pool (advisor.isolation), waited for in the thread pool so the event loop keeps answering."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, PlainTextResponse
from pydantic import ValidationError

from advisor.estimate import MemoryEstimate
from advisor.estimate.parallel import LayoutEstimate
from advisor.plan.model import PlanResult
from advisor.store.records import (
    JOB_STATUSES,
    SORTABLE,
    TRIAL_STATUSES,
    JobRecord,
    StudyRecord,
    TrialQuery,
    TrialRecord,
)
from api.app import STATIC, AppState
from api.schemas import (
    MAX_PAGE,
    BestSoFar,
    ErrorBody,
    EstimateRequest,
    HardwareItem,
    Job,
    JobAccepted,
    LayoutEstimateRequest,
    Page,
    PlanRequest,
    Progress,
    RecommendRequest,
    RecommendResponse,
    Study,
    Trial,
    TuneJobRequest,
    WorkloadItem,
)
from api.security import check_workload, require_token

router = APIRouter()
v1 = APIRouter(prefix="/v1")
ERRORS: dict[int | str, dict[str, Any]] = {422: {"model": ErrorBody, "description": "Invalid input: what and why."}}
# Routes that load a workload: a module outside ADVISOR_WORKLOAD_MODULES, or a file path, is a 403; a
# workload that fails in its isolated worker is a 422; a full pool of workers a 503 with Retry-After.
WORKLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "The workload is not a preset or an allowed module."},
    422: {"model": ErrorBody, "description": "Invalid input, or the workload failed in its isolated worker: it "
          "crashed, ran past ADVISOR_API_ESTIMATE_TIMEOUT_S or the memory cap, exited or raised (the detail says "
          "which part of it, doing what)."},
    503: {"model": ErrorBody, "description": "Every isolated worker is busy and ADVISOR_API_QUEUE requests wait, "
          "or the store is unreachable; try again after Retry-After seconds.",
          "headers": {"Retry-After": {"description": "Seconds to wait before trying again.",
                                      "schema": {"type": "integer"}}}}}
PAGE_LIMIT = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Rows per page (at most {MAX_PAGE}).")]
PAGE_OFFSET = Annotated[int, Query(ge=0, le=10**9, description="Rows skipped.")]


def _state(request: Request) -> AppState:
    return request.app.state.advisor


# -- the page, health, metrics ----------------------------------------------------------------------
@router.get("/", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    path = STATIC / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise HTTPException(404, "no such file")
    return FileResponse(path)


@router.get("/healthz", tags=["service"], responses={503: {"model": ErrorBody}})
def healthz(request: Request) -> dict[str, str]:
    """200 when the store answers; 503 when it does not."""
    _state(request).store().best_generation()
    return {"status": "ok", "store": "ok"}


@router.get("/metrics", tags=["service"], response_class=PlainTextResponse)
def metrics(request: Request) -> Response:
    """Prometheus text: requests by route and status, latency histograms, jobs and trials by status."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- catalog ----------------------------------------------------------------------------------------
@v1.get("/hardware", tags=["catalog"])
def hardware() -> list[HardwareItem]:
    """The hardware catalog: names accepted wherever a hardware spec is (`NAME[:devices[xnodes]]`)."""
    from advisor.hardware import CATALOG

    return [HardwareItem(name=k, spec=v.model_dump(mode="json")) for k, v in CATALOG.items()]


@v1.get("/workloads", tags=["catalog"])
def workloads(request: Request) -> list[WorkloadItem]:
    """Built-in workload presets and the keyword arguments each takes."""
    from advisor.presets import PRESETS

    out = []
    for name, preset in PRESETS.items():
        sig = inspect.signature(preset)
        params = {p.name: (None if p.default is inspect.Parameter.empty else p.default)
                  for p in sig.parameters.values()}
        doc = inspect.getdoc(preset.target()) if hasattr(preset, "target") else None
        out.append(WorkloadItem(name=name, parameters=_jsonable(params),
                                description=(doc or "").split("\n")[0] or None))
    return out


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in d.items()}


# -- estimate and recommend -------------------------------------------------------------------------
@v1.post("/estimate", tags=["advice"], responses=WORKLOAD_ERRORS)
def estimate(body: EstimateRequest, request: Request) -> MemoryEstimate:
    """Per-device memory (parameters, gradients, optimizer state, activations, temporaries, overhead),
    whether it fits, and the largest batch that does, without touching a device. The workload is
    traced in an isolated worker. No calibration run is made for a request: a CPU calibration kept
    on this host is used where there is one (the notes say which; `advisor estimate` may make one)."""
    from advisor import isolation
    from advisor.hardware import check_hardware

    state = _state(request)
    check_workload(body.workload, state.settings)
    check_hardware(body.hardware)  # a 422 that takes no worker from the pool
    knobs, options = body.knobs()
    return isolation.estimate(body.workload, body.hardware, knobs, options, workload_args=body.load_args(),
                              timeout_s=state.settings.api_estimate_timeout_s, pool=state.pool)


@v1.post("/estimate/layout", tags=["advice"], responses=WORKLOAD_ERRORS)
def estimate_layout(body: LayoutEstimateRequest, request: Request) -> LayoutEstimate:
    """Per-device memory of a parallel layout, one figure per pipeline rank (its stages: the first holds the
    embedding, the last the head and the loss), with each rank's collective bytes per step by kind. The workload
    is traced (one rank of each pipeline stage, under a fake process group) in an isolated worker."""
    import advisor.estimate as estimator
    from advisor import isolation
    from advisor.hardware import get_hardware
    from advisor.parallel.layout import layout_over

    state = _state(request)
    check_workload(body.workload, state.settings)
    hw = get_hardware(body.hardware)
    layout = layout_over(hw.world_size, tp=body.tp, pp=body.pp, cp=body.cp, dp_replicate=body.dp_replicate,
                         where=body.hardware, strategy=body.strategy,
                         schedule=body.schedule, microbatches=body.microbatches, virtual_stages=body.virtual_stages,
                         sequence_parallel=body.sequence_parallel)
    knobs = estimator.EstimateRequest.of(body.batch_size, precision=body.precision, optimizer=body.optimizer,
                                         strategy=body.strategy, checkpointing=body.checkpointing,
                                         optimizer_impl=body.optimizer_impl, offload_optimizer=body.offload_optimizer,
                                         offload_params=body.offload_params)
    return isolation.estimate_layout(body.workload, hw, layout, knobs, workload_args=body.workload_args,
                                     margin=body.margin, grad_accum=body.grad_accum,
                                     timeout_s=state.settings.api_estimate_timeout_s, pool=state.pool)


@v1.post("/recommend", tags=["advice"], response_model=RecommendResponse, responses=WORKLOAD_ERRORS)
async def recommend(body: RecommendRequest, request: Request) -> Response:
    """How to train the workload on each candidate hardware type, best first, each `measured` (the
    stored best for this workload and hardware), `transferred` (a stored best elsewhere, adjusted
    by the estimator) or `estimated` (estimator and roofline only), with the reason. With prices,
    ranked by cost per epoch. Served from memory until the store's best configurations change."""
    from advisor.recommend import check_candidates
    from api.cache import cache_key

    state = _state(request)
    check_workload(body.workload, state.settings)
    check_candidates(body.hardware, body.prices)  # a 422 that takes no worker from the pool
    cache = state.recommend_cache
    if not cache.enabled:
        return Response(await run_in_threadpool(_recommend_bytes, state, body), media_type="application/json")
    key = cache_key(body.model_dump(mode="json"))
    generation = await cache.generation()
    hit = cache.get(key, generation)
    if hit is None:
        hit = await run_in_threadpool(_recommend_bytes, state, body)
        cache.put(key, generation, hit)
    return Response(hit, media_type="application/json")


def _recommend_bytes(state: AppState, body: RecommendRequest) -> bytes:
    """The recommendation, computed in an isolated worker (which opens the store by URL itself)."""
    from advisor.isolation import run_isolated
    from advisor.recommend import recommend as recommend_fn

    recs = run_isolated(recommend_fn, body.workload, body.hardware, workload_args=body.load_args(),
                        db=state.db_url, prices=body.prices, spec=body.workload, what="the recommendation",
                        stage=f"loading {body.workload}", timeout_s=state.settings.api_estimate_timeout_s,
                        pool=state.pool)
    return RecommendResponse(workload=body.workload, recommendations=recs).model_dump_json().encode()


@v1.post("/plan", tags=["advice"], responses=WORKLOAD_ERRORS)
def plan(body: PlanRequest, request: Request) -> PlanResult:
    """`advisor plan`: the fastest ways to train a decoder on GPU targets (or the cheapest per token, with prices).
    Meshes (dp, tp, pp, cp), sharding, micro-batch and accumulation for the global batch, checkpointing and
    offload, pruned by per-device memory and ranked by predicted step time; each plan with its memory and step
    time by part. Where none fits, the closest plans (fits false) and `what_would_fit`. The search runs in an
    isolated worker under ADVISOR_API_ESTIMATE_TIMEOUT_S; a `pkg.module:build` workload is described in a worker
    of its own first."""
    from advisor.isolation import run_isolated
    from advisor.plan.search import plan as plan_fn

    state = _state(request)
    check_workload(body.workload, state.settings)
    planned, name = _plan_request(body, state)
    result = run_isolated(plan_fn, planned, spec=planned.workload or "decoder", what="the plan",
                          stage=f"planning {body.workload}", timeout_s=state.settings.api_estimate_timeout_s,
                          pool=state.pool)
    return result if name is None else result.model_copy(update={"workload": name})


def _plan_request(body: PlanRequest, state: AppState):  # noqa: ANN202 (advisor.plan.model.PlanRequest, name)
    """The planner's request, and the workload's name where it is not the planner's to find: a preset is loaded
    by the planner in its worker; `pkg.module:build` code is described in a worker of its own (retired after it),
    and the planner gets its decoder's shape."""
    from advisor.errors import SpecError, invalid_input
    from advisor.plan.model import PlanRequest as Planned

    known = dict(workload_args=body.workload_args, workload=body.workload, arch=None)
    name = None
    if ":" in body.workload and not body.workload.startswith("hf:"):  # hf: configs are the planner's to read
        from advisor.isolation import describe

        info = describe(body.workload, body.workload_args, timeout_s=state.settings.api_estimate_timeout_s,
                        pool=state.pool)
        if info.decoder is None:
            raise SpecError(f"{body.workload} is not a decoder; the planner covers decoder models")
        known, name = dict(workload_args={}, workload=None, arch=info.decoder), info.name
        if body.finetune is not None and not body.finetune.empty:  # as advisor.finetune.finetuned names it
            name += "+lora" if body.finetune.lora is not None else "+freeze"
    try:
        return Planned(hardware=body.hardware, nodes=body.nodes, global_batch_size=body.global_batch_size,
                       fixed=body.fix, prices=body.prices, objective=body.objective, top=body.top,
                       margin=body.margin, finetune=body.finetune, **known), name
    except ValidationError as exc:
        raise invalid_input(exc) from exc


# -- stored results ---------------------------------------------------------------------------------
def trial_out(r: TrialRecord) -> Trial:
    return Trial.model_validate(r.model_dump(mode="json", exclude={"result", "estimate", "owner", "software_fp"}))


def _status_filter(values: list[str] | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
    bad = [v for v in values or [] if v not in allowed]
    if bad:
        raise HTTPException(422, f"status {bad[0][:40]!r} is not one of {', '.join(allowed)}")
    return tuple(values or ())


@v1.get("/results", tags=["results"], responses=ERRORS)
def results(request: Request, limit: PAGE_LIMIT = 50, offset: PAGE_OFFSET = 0,
            workload: Annotated[str | None, Query(max_length=200,
                                                  description="Name or fingerprint (prefix of 8+).")] = None,
            hardware: Annotated[str | None, Query(max_length=200,
                                                  description="Name or fingerprint (prefix of 8+).")] = None,
            study: Annotated[str | None, Query(max_length=200, description="Study name or id.")] = None,
            status_: Annotated[list[str] | None, Query(alias="status",
                                                       description="Repeatable: ok, oom, pruned, ...")] = None,
            sort: Annotated[str, Query(max_length=40,
                                       description=f"One of {', '.join(SORTABLE)}; '-' for descending.")] = "-id",
            ) -> Page[Trial]:
    """Stored trials across studies, filtered and paged (newest first by default)."""
    try:
        query = TrialQuery(workload=workload, hardware=hardware, study=study,
                           status=_status_filter(status_, TRIAL_STATUSES), sort=sort, limit=limit, offset=offset)
    except ValidationError as exc:
        raise HTTPException(422, exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    store = _state(request).store()
    return Page[Trial](items=[trial_out(r) for r in store.query_trials(query)], total=store.count_trials(query),
                       limit=limit, offset=offset)


def _best_trial(store, rec: StudyRecord) -> TrialRecord | None:
    """The study's best ok trial by its objective's first metric."""
    metric = rec.objective.metrics[0]
    found = store.query_trials(TrialQuery(study=rec.id, status=("ok",), limit=1,
                                          sort=("-" if metric.direction == "maximize" else "") + metric.name))
    return found[0] if found and getattr(found[0], metric.name) is not None else None


def _study_out(store, rec: StudyRecord, counts: dict[str, int], *, space: bool = False) -> Study:
    best = _best_trial(store, rec)
    return Study(id=rec.id, name=rec.name, workload_name=rec.workload_name or "", workload_fp=rec.workload_fp,
                 hardware_name=rec.hardware_name or "", hardware_fp=rec.hardware_fp, status=rec.status,
                 objective=rec.objective.key, created_at=rec.created_at, finished_at=rec.finished_at,
                 trial_counts=counts, best=trial_out(best) if best else None, space=rec.space if space else None)


@v1.get("/studies", tags=["results"], responses=ERRORS)
def studies(request: Request, limit: PAGE_LIMIT = 50, offset: PAGE_OFFSET = 0) -> Page[Study]:
    """Studies, newest first, with trials by status and the best so far."""
    store = _state(request).store()
    recs, total = store.list_studies(limit=limit, offset=offset)
    counts = store.trial_counts([r.id for r in recs])
    return Page[Study](items=[_study_out(store, r, counts[r.id]) for r in recs], total=total, limit=limit,
                       offset=offset)


def _study_or_404(store, study_id: int) -> StudyRecord:
    rec = store.get_study(study_id)
    if rec is None:
        raise HTTPException(404, f"no study with id {study_id}")
    return rec


@v1.get("/studies/{study_id}", tags=["results"], responses={404: {"model": ErrorBody}, **ERRORS})
def study(study_id: int, request: Request) -> Study:
    """One study: its search space, trials by status and the best."""
    store = _state(request).store()
    rec = _study_or_404(store, _id(study_id))
    return _study_out(store, rec, store.trial_counts([rec.id])[rec.id], space=True)


@v1.get("/studies/{study_id}/trials", tags=["results"], responses={404: {"model": ErrorBody}, **ERRORS})
def study_trials(study_id: int, request: Request, limit: PAGE_LIMIT = 100, offset: PAGE_OFFSET = 0) -> Page[Trial]:
    """A study's trials in the order they were started."""
    store = _state(request).store()
    rec = _study_or_404(store, _id(study_id))
    query = TrialQuery(study=rec.id, sort="id", limit=limit, offset=offset)
    return Page[Trial](items=[trial_out(r) for r in store.query_trials(query)], total=store.count_trials(query),
                       limit=limit, offset=offset)


def _id(value: int) -> int:
    if not 1 <= value <= 2**63 - 1:
        raise HTTPException(404, f"no study with id {value}")
    return value


# -- tune jobs --------------------------------------------------------------------------------------
def job_out(store, job: JobRecord) -> Job:
    total = int(job.request.get("trials", 1))
    done, best = 0, None
    if job.study_id is not None:
        counts = store.trial_counts([job.study_id])[job.study_id]
        done = sum(n for status_, n in counts.items() if status_ != "running")
        rec = store.get_study(job.study_id)
        top = _best_trial(store, rec) if rec is not None else None
        if top is not None:
            best = BestSoFar(trial_id=top.id, samples_per_s=top.samples_per_s, tokens_per_s=top.tokens_per_s,
                             peak_memory_bytes=top.peak_memory_bytes, config=top.config.model_dump(mode="json"))
    shown = min(done, total)
    return Job(id=job.id, status=job.status, request=job.request, study_id=job.study_id, study_name=job.study_name,
               progress=Progress(done=shown, total=total, fraction=shown / total if total else 1.0), best=best,
               error=job.error, worker=job.owner, created_at=job.created_at, started_at=job.started_at,
               finished_at=job.finished_at)


@v1.post("/tune", tags=["jobs"], status_code=status.HTTP_202_ACCEPTED, dependencies=[Depends(require_token)],
         responses={401: {"model": ErrorBody}, **WORKLOAD_ERRORS})
def tune(body: TuneJobRequest, request: Request, response: Response) -> JobAccepted:
    """Queue a tuning study (needs the bearer token). A worker runs it outside the request; poll
    GET /v1/jobs/{id}. The same request again continues the same study."""
    from api.jobs import devices_needed, validate_job

    state = _state(request)
    check_workload(body.workload, state.settings)
    validate_job(body, pool=state.pool, timeout_s=state.settings.api_estimate_timeout_s)
    needed = devices_needed(body.hardware)
    job = _queue(state).submit(body.model_dump(mode="json"), needed)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobAccepted(job_id=job.id, status=job.status, href=f"/v1/jobs/{job.id}")


def _queue(state: AppState):  # noqa: ANN202
    from advisor.store.jobs import JobQueue

    return JobQueue(state.store())


def _job_or_404(state: AppState, job_id: str) -> JobRecord:
    job = _queue(state).get(job_id) if len(job_id) <= 64 else None
    if job is None:
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    return job


@v1.get("/jobs", tags=["jobs"], responses=ERRORS)
def jobs(request: Request, limit: PAGE_LIMIT = 50, offset: PAGE_OFFSET = 0,
         status_: Annotated[list[str] | None, Query(alias="status",
                                                    description="Repeatable: queued, running, ...")] = None,
         ) -> Page[Job]:
    """Tune jobs, newest first."""
    state = _state(request)
    found, total = _queue(state).list(status=_status_filter(status_, JOB_STATUSES), limit=limit, offset=offset)
    store = state.store()
    return Page[Job](items=[job_out(store, j) for j in found], total=total, limit=limit, offset=offset)


@v1.get("/jobs/{job_id}", tags=["jobs"], responses={404: {"model": ErrorBody}})
def job(job_id: str, request: Request) -> Job:
    """A job's status, progress (trials done of its budget) and best configuration so far."""
    state = _state(request)
    return job_out(state.store(), _job_or_404(state, job_id))


@v1.delete("/jobs/{job_id}", tags=["jobs"], status_code=status.HTTP_202_ACCEPTED, dependencies=[Depends(require_token)],
           responses={401: {"model": ErrorBody}, 403: {"model": ErrorBody}, 404: {"model": ErrorBody},
                      409: {"model": ErrorBody}})
def cancel(job_id: str, request: Request) -> Job:
    """Cancel a job (needs the bearer token): a queued job is cancelled at once; a running one is
    stopped by its worker (its trials killed) and ends `cancelled`. The study and its finished
    trials stay in the store."""
    state = _state(request)
    before = _job_or_404(state, job_id)
    if before.status in ("cancelled", "finished", "failed"):
        raise HTTPException(409, f"job {job_id} is {before.status} already")
    after = _queue(state).cancel(job_id)
    assert after is not None
    return job_out(state.store(), after)

