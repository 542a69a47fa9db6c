"""`run_tune`: Optuna samplers driven through Ray Tune's OptunaSearch over measured trials, run one at a time by
this process (inline) or by Ray Tune's trial runner (side by side on a node's GPUs, or on a cluster).

The study lives in our store and, for the sampler, in Optuna's RDB storage in the same database
(optuna-dashboard opens it). A rerun after a crash or SIGKILL continues the same study: Optuna
loads its finished trials (the sampler learns from them), stale RUNNING ones are failed, and
configurations that were being measured are retried once (before anything new).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from advisor.errors import SpecError
from advisor.store.records import Objective, RecordStatus, StudySpec
from advisor.trial import TrainingConfig
from advisor.tune.request import TuneRequest
from advisor.tune.summary import TuneSummary, summarize_study
from advisor.tune.trainable import StudyContext, evaluate, fork_server_address, inline_imports, ray_trainable

log = logging.getLogger(__name__)
RAY_TEMP_MAX = 48  # characters: Ray appends ~60 (session_<date>_<pid>/sockets/plasma_store)
DUPLICATE_FACTOR = 4  # Ray trials allowed per distinct configuration (samplers repeat themselves)


def _objective(req: TuneRequest, tokens: bool) -> Objective:
    metrics = [{"name": "tokens_per_s" if tokens else "samples_per_s", "direction": "maximize"}]
    if req.objective == "throughput,memory":
        metrics.append({"name": "peak_memory_bytes", "direction": "minimize"})
    return Objective(metrics=metrics)


def _quiet_optuna() -> None:
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our progress bar says what Optuna's log would
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def _sampler(req: TuneRequest):
    import optuna

    name = req.resolved_sampler()
    if name == "tpe":  # the screen may spend every trial but the baseline (one screen at least); TPE the rest
        from advisor.tune.screening import ScreeningSampler

        return ScreeningSampler(_tpe(req, multivariate=True), max_screens=max(1, req.trials - 1))
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=req.seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=req.seed)
    if name == "brute-force":
        return optuna.samplers.BruteForceSampler(seed=req.seed)
    return _tpe(req)


def _tpe(req: TuneRequest, multivariate: bool = False):
    import optuna

    # Random draws before TPE models the space: Optuna's 10 is most of a small budget; keep a quarter
    # (the screen's trials, where it runs first, count towards them). Multivariate TPE models the knobs
    # jointly (what they do together), `group` splits a define-by-run space by which knobs a trial has.
    return optuna.samplers.TPESampler(seed=req.seed, n_startup_trials=min(5, max(2, req.trials // 4)),
                                      multivariate=multivariate, group=multivariate)


def _seed_reference(storage, store, space, context, ctx: StudyContext, study, base: TrainingConfig) -> None:
    """The measured baseline into the Optuna study as a finished trial: every sampler learns from it,
    the screen starts from it, brute force does not draw it again. Skipped when the baseline is
    not a point of the space (a fixed knob excludes it) or has no finished measurement."""
    import warnings

    import optuna

    from advisor.store import config_hash
    from advisor.store.records import TrialQuery
    from advisor.tune.screening import add_reference, contains
    from advisor.tune.trainable import metrics_of
    from search_spaces import suggest
    from search_spaces.spec import KNOBS

    found = store.query_trials(TrialQuery(study=study.id, config_hash=config_hash(base), sort="-attempt", limit=1))
    if not found or found[0].status in (RecordStatus.running, RecordStatus.interrupted):
        return
    fixed = optuna.trial.FixedTrial({k: v for k, v in base.model_dump(mode="json").items() if k in KNOBS})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FixedTrial warns of a value outside a range; checked below
        try:
            config = suggest(space, fixed, context)
        except ValueError:  # and raises for one outside a knob's choices (a space without the preset's batch)
            return
    if config is None or config_hash(config) != config_hash(base) or \
            not all(contains(d, fixed.params[k]) for k, d in fixed.distributions.items()):
        return
    metrics = metrics_of(found[0], ctx, reused=True)
    values = [metrics["objective"]] + ([metrics["memory"]] if len(ctx.objective.metrics) > 1 else [])
    ot_study = optuna.create_study(storage=storage, study_name=study.optuna_study_name, load_if_exists=True,
                                   directions=[m.direction for m in ctx.objective.metrics])
    add_reference(ot_study, fixed.params, fixed.distributions, values, bottleneck=found[0].bottleneck)


def _optuna_storage(url: str):
    """Optuna's RDB storage in our database; trials a killed run left RUNNING become FAIL."""
    import optuna

    from advisor.store.migrate import schema_lock

    kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
    with schema_lock(url):  # its first open creates tables and types: one process at a time
        storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        _complete_indexes(storage.engine)
        return storage


def _complete_indexes(engine) -> None:  # noqa: ANN001 - a SQLAlchemy Engine
    """Create those of Optuna's indexes its tables lack. SQLite commits each DDL statement on its own, so a
    first open killed between a CREATE TABLE and its CREATE INDEX leaves `studies` without its unique index
    on study_name, and later opens skip an existing table whole: every create_study(load_if_exists=True)
    then adds another study of that name, until a lookup finds two (MultipleResultsFound). A job's process
    dies with its worker (api/jobs.py), so a worker killed while a job opens Optuna's storage tears it so.
    A torn store used since holds studies of one name twice: they are told apart first
    (`_rename_duplicate_studies`)."""
    import sqlalchemy as sa
    from optuna.storages._rdb import models  # Optuna's own table definitions (no public handle on them)

    for table in models.BaseModel.metadata.sorted_tables:
        present = {i["name"] for i in sa.inspect(engine).get_indexes(table.name)}
        for index in table.indexes:
            if index.name in present:
                continue
            if table.name == models.StudyModel.__tablename__:
                _rename_duplicate_studies(engine, models)
            index.create(engine)


def _rename_duplicate_studies(engine, models) -> None:  # noqa: ANN001 - a SQLAlchemy Engine, Optuna's models
    """Before the unique index on study_name goes on a torn store that already took a second study of one
    name: the study with the most trials (the first of them on a tie) keeps the name, the others become
    `<name>~duplicate-<id>` with their trials, so the index can be created and nothing is lost."""
    import sqlalchemy as sa

    studies, trials = models.StudyModel.__table__, models.TrialModel.__table__
    counts = (sa.select(studies.c.study_id, studies.c.study_name, sa.func.count(trials.c.trial_id).label("n"))
              .select_from(studies.outerjoin(trials, trials.c.study_id == studies.c.study_id))
              .group_by(studies.c.study_id, studies.c.study_name))
    with engine.begin() as conn:
        by_name: dict[str, list[tuple[int, int]]] = {}
        for study_id, name, n in conn.execute(counts):
            by_name.setdefault(name, []).append((-n, study_id))
        for name, rows in by_name.items():
            for _, study_id in sorted(rows)[1:]:
                renamed = f"{name}~duplicate-{study_id}"
                conn.execute(studies.update().where(studies.c.study_id == study_id).values(study_name=renamed))
                log.warning("Optuna's store held study %r twice (a first open killed halfway); study %d is now %r",
                            name, study_id, renamed)


# A RUNNING Optuna trial without an owner is stale only once it is this old (s): a live tuner names
# itself first thing after asking (DefineByRun), but another tuner reading the trials in between,
# then failing the trial as the first writes its first knobs, leaves a finished trial with part of
# a configuration, and Optuna's brute-force sampler refuses such a study ("param_name mismatch"
# with two tuners on one PostgreSQL study).
OWNERLESS_GRACE_S = 120.0


def _fail_stale(storage, study_name: str) -> int:
    """Optuna trials left RUNNING by a tuner that is gone become FAIL; another live tuner's stay,
    and so does one just asked (no owner yet, younger than OWNERLESS_GRACE_S)."""
    import datetime

    import optuna

    from advisor.store.sql import owner_gone

    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return 0
    # Optuna stamps datetime_start with the asking host's naive local time
    born_before = datetime.datetime.now() - datetime.timedelta(seconds=OWNERLESS_GRACE_S)

    def gone(t) -> bool:  # noqa: ANN001 (a FrozenTrial)
        if "owner" in t.user_attrs:
            return owner_gone(t.user_attrs["owner"])
        return t.datetime_start is None or t.datetime_start < born_before

    stale = [t for t in storage.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
             if gone(t)]
    for trial in stale:
        storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.FAIL)
    return len(stale)


class DefineByRun:
    """Optuna's define-by-run space: suggest the knobs whose conditions hold; the whole config rides
    along as one constant, so the trainable gets exactly what the space decided. A module-level
    class because Ray pickles the searcher (and this with it) in its experiment checkpoints."""

    def __init__(self, space, context, owner: str) -> None:
        self.space, self.context, self.owner = space, context, owner

    def __call__(self, trial) -> dict[str, Any]:
        from search_spaces import suggest

        trial.set_user_attr("owner", self.owner)  # whose it is, so a later run can tell stale from live
        config = suggest(self.space, trial, self.context)
        return {"training_config": config.model_dump_json() if config is not None else None}


class _Budget:
    """Stops the experiment at the distinct-configuration budget, the patience, or the time limit. The budget is
    the study's: `held`, the ids of the trials it had finished when the run began (which `remaining` already
    leaves out)."""

    def __init__(self, remaining: int, patience: int | None, held: set[int] | frozenset[int] = frozenset()) -> None:
        self.remaining, self.patience, self.held = remaining, patience, held
        self.seen: set[int] = set()
        self.best: float | None = None
        self.since_best = 0
        self.repeats = 0  # trials of this run that measured a configuration again
        self.reason: str | None = None
        self.measured = 0  # configurations this run measured itself (not reused, pruned, or another tuner's)
        self.trial_s = 0.0  # wall time of the trials measured in this run (s)
        self.estimate_s = 0.0  # time their memory estimates took before them (s)
        self.started = time.monotonic()

    def observe(self, result: dict[str, Any]) -> None:
        rid = result.get("record_id")
        # A configuration reused from another study's measurement is new to this study and counts, and so does one
        # that another tuner of this study measured while this run went on (the draw finds it taken); a repeat of
        # one the study held when the run began does not.
        if rid is None or rid in self.seen or result.get("duplicate") and rid in self.held:
            return
        self.seen.add(rid)
        if result.get("trial_wall_s", 0.0) > 0:
            self.measured += 1
        self.trial_s += result.get("trial_wall_s", 0.0)  # 0 for a reused measurement
        self.estimate_s += result.get("estimate_s", 0.0)
        value = result.get("objective", 0.0)
        if result.get("repeat"):
            self.repeats += 1  # a leader measured again: neither a find nor a miss for the patience
        elif result.get("status") == "ok" and (self.best is None or value > self.best):
            self.best, self.since_best = value, 0
        else:
            self.since_best += 1
        if len(self.seen) >= self.remaining:
            self.reason = f"ran the {self.remaining} trial(s) this run's budget allows"
        elif self.patience and self.since_best >= self.patience:
            self.reason = f"no better configuration in the last {self.patience} trials"

    def done(self) -> bool:
        return self.reason is not None


class _Confirm:
    """When the search hands over to measuring leaders again, and which (advisor/tune/confirm.py): once all but
    `reserve` of the run's trials are measured, each next trial measures the least measured contender again,
    as long as there is one; the search has the trials left where there is none."""

    def __init__(self, budget: _Budget, reserve: int, store, study_id: int, metric: str) -> None:  # noqa: ANN001
        self.budget, self.reserve, self.store, self.study_id, self.metric = budget, reserve, store, study_id, metric

    def due(self) -> bool:
        return self.reserve > 0 and len(self.budget.seen) >= self.budget.remaining - self.reserve

    def pick(self) -> str | None:
        from advisor.tune.confirm import next_repeat

        config = next_repeat(self.store.study_trials(self.study_id), self.metric)
        return config.model_dump_json() if config is not None else None


def _ray_env() -> None:
    """Ray's settings read from the environment, set before Ray Tune is first imported."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the new output prints a banner even at verbose=0
    # Tune's default loggers include TensorBoard's, and tensorboardX imports torch into the driver (1.3 s on a
    # 2-core host, before the first trial can start); `_fit` adds the CSV and JSON ones itself.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # Tune warns when handling one result takes over 0.5 s; ours (the store, Optuna's tell) can,
    # next to trials that take seconds to minutes, so the warning would only be noise.
    os.environ.setdefault("TUNE_WARN_THRESHOLD_S", "30")
    # Ray starts its workers at niceness 15, and the trials (the fork server, its ranks, their
    # DataLoader workers) inherit it: any other work on the host then takes the CPU first. A trial
    # measures the machine, so it runs at the driver's niceness; read by the raylet this process starts
    # (a joined cluster's nodes need it set where they start). Evidence: bench/tune_load.py,
    # bench/results/tune-load.md.
    os.environ.setdefault("RAY_worker_niceness", "0")


def _ray_init(req: TuneRequest) -> tuple[bool, Path | None]:
    """Start a local Ray (temp dir under the data dir) or join --ray-address: (True if we started it, its temp
    dir where this call made it)."""
    _ray_env()
    import ray

    from advisor.settings import get_settings

    if ray.is_initialized():
        return False, None
    env = {k: v for k, v in os.environ.items() if k.startswith("ADVISOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    common = dict(log_to_driver=False, configure_logging=False)
    if req.ray_address:  # a cluster's workers get our settings and working dir through a runtime env
        ray.init(address=req.ray_address, runtime_env={"env_vars": env}, **common)
        return True, None
    temp = get_settings().data_dir / "ray"
    if len(str(temp)) > RAY_TEMP_MAX:  # Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        import tempfile

        temp = Path(tempfile.mkdtemp(prefix="advisor-ray-"))
        log.warning("data dir path too long for Ray's sockets; Ray's temp dir is %s", temp)
    made = None if temp.exists() else temp
    temp.mkdir(parents=True, exist_ok=True)
    # A local Ray's workers inherit this environment (the raylet starts with it), so they need no runtime
    # env: one would start a fresh worker for the first trial (seconds) where a prestarted one can serve.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    try:
        ray.init(_temp_dir=str(temp), include_dashboard=False, num_cpus=len(os.sched_getaffinity(0)), **common)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return True, made


def _shutdown_ray() -> None:
    """ray.shutdown() without its wait on the autoscaler's monitor, which has nothing to scale on a local Ray: Ray
    stops its processes one by one, giving each 1 s to exit on SIGTERM, and the monitor takes all of it."""
    import ray
    from ray._private import ray_constants

    node = getattr(ray._private.worker, "_global_node", None)  # the local Ray this process started, if any
    for info in (getattr(node, "all_processes", None) or {}).get(ray_constants.PROCESS_TYPE_MONITOR, []):
        info.process.kill()
    ray.shutdown()


def _resources(hw) -> Callable[[dict[str, Any]], dict[str, float]]:
    """CPUs and GPUs a trial reserves: on a CPU target the whole machine (trials must not share cores)."""
    import ray

    # A CPU trial takes a whole node (trials must not share cores): the largest node's CPUs, not the
    # cluster's total, which no single node could hold.
    total_cpu = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=1.0) or 1.0

    def per_trial(config: dict[str, Any]) -> dict[str, float]:
        raw = config.get("training_config")
        if hw.device_type == "cpu" or raw is None:
            return {"cpu": total_cpu}
        tc = TrainingConfig.model_validate_json(raw)
        per_gpu = max(1.0, total_cpu / max(hw.devices_per_node, 1))
        return {"cpu": min(total_cpu, tc.nproc * min(per_gpu, tc.num_workers + 1)), "gpu": float(tc.nproc)}

    return per_trial


def _prepare(req: TuneRequest, *, pool=None, timeout_s: float | None = None):  # noqa: ANN001 - WorkerPool, lazily
    """Workload, hardware, space, context and baseline; SpecError for anything the user got wrong. The workload
    is loaded in an isolated worker of `pool` (default: this process's) within `timeout_s` (default: settings')."""
    from advisor import isolation
    from advisor.finetune import has_lora
    from advisor.hardware import get_hardware
    from search_spaces import SpaceContext, apply_fixes, baseline, load_space

    hw = get_hardware(req.hardware)
    if req.fixes.get("lora_r") is not None and not has_lora(req.workload_args):
        raise SpecError("--fix lora_r needs a LoRA fine-tune (--lora r=R --lora-targets NAMES)")
    wl = isolation.describe(req.workload, req.workload_args, pool=pool, timeout_s=timeout_s)
    space = apply_fixes(load_space(req.space), req.fixes)
    try:
        context = SpaceContext.for_target(hw, wl, global_batch_size=req.global_batch_size,
                                          lora=has_lora(req.workload_args))
    except ValueError as exc:
        raise SpecError(str(exc).splitlines()[-1]) from exc
    return wl, hw, space, context, baseline(context)


def _open_study(req: TuneRequest, store, wl, hw, space, objective: Objective):
    from advisor.store import hardware_fingerprint, software_fingerprint, software_versions

    spec = StudySpec(name=req.study_name(wl.name, hw.accelerator.name), workload_fp=wl.fingerprint,
                     workload_name=wl.name, workload_description={"spec": req.workload, "args": req.workload_args},
                     hardware_fp=hardware_fingerprint(hw), hardware_name=hw.accelerator.name,
                     hardware_spec=hw.model_dump(mode="json"), space=space.model_dump(mode="json"),
                     objective=objective, software=software_versions())
    study = store.create_or_get_study(spec)
    ctx = StudyContext(request=req, study_id=study.id, workload_fp=spec.workload_fp, hardware_fp=spec.hardware_fp,
                       software_fp=software_fingerprint(), db_url=store.url, objective=objective,
                       owner=store.owner)
    return study, ctx


def run_tune(req: TuneRequest, *, on_result: Callable[[dict[str, Any], int, int], None] | None = None,
             on_study: Callable[[Any], None] | None = None) -> TuneSummary:
    """Tune `req.workload` on `req.hardware`; see the module docstring. Returns the study's summary.
    `on_result(result, done, total)` after each trial; `on_study(StudyRecord)` once the study is open."""
    from advisor.isolation.pool import default_pool
    from advisor.store import config_hash
    from advisor.tune.seeds import planner_seeds

    t0 = time.monotonic()
    default_pool().warm()  # the workload loads in its worker: its server's imports (seconds) start first
    req = req.absolute()
    inline = _inline(req, _check_target(req))  # a wrong hardware, space or fix is told before anything starts
    # Ray starts here while a thread loads the workload in its isolated worker and opens the store (seconds
    # each, mostly other processes' imports); a workload that cannot load leaves no store, study or Ray behind
    opening = _Opening(req, ahead=inline)  # a local Ray's trials estimate in their actors' own workers
    started, made = False, None
    try:
        if inline:
            _ray_env()  # Ray Tune's searchers are imported all the same
        else:
            started, made = _ray_init(req)
        import advisor.tune.ray_hooks  # noqa: F401 - Ray Tune's import (a second), beside the opening
        import advisor.tune.searcher  # noqa: F401
        if inline:
            inline_imports()  # beside the workload's load: see its docstring
        wl, hw, space, context, base, store, study, ctx, interrupted = opening.result()
    except BaseException:
        if started:
            _shutdown_ray()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if on_study is not None:
        on_study(study)
    retries = [r.config for r in store.retries_due(study.id)]
    records = store.study_trials(study.id)
    finished = [r for r in records if r.status not in (RecordStatus.running, RecordStatus.interrupted)]
    done = {r.config_hash for r in finished}
    queued = ([] if config_hash(base) in done else [base]) + retries
    remaining = max(0, req.trials - len(finished))  # a measurement taken again counts as a trial
    # the planner's fastest plans next (GPUs, a decoder), within the trial budget
    seeds = [c for c in planner_seeds(wl.decoder, hw, space, context, base)
             if config_hash(c) not in done][:max(0, remaining - len(queued))]
    queued += seeds
    stats = {"interrupted": interrupted, "retried": len(retries), "resumed_from": len(done), "planned": len(seeds),
             "executor": "inline" if inline else "ray"}
    stats["start_s"] = time.monotonic() - t0  # the workload's load, the store, a local Ray's start (overlapping)
    try:
        if remaining:
            if not inline and req.ray_address is None:  # a local Ray's actor forks through this process's server
                ctx = ctx.model_copy(update={"fork_server": fork_server_address()})
            stats.update(_search(req, hw, (space, context, base), ctx, store, study, queued, remaining, on_result,
                                 inline=inline, held={r.id for r in finished}, ahead=opening.wait_ahead))
    finally:
        if started:
            stopping = time.monotonic()
            _shutdown_ray()
            stats["stop_s"] = time.monotonic() - stopping
    store.finish_study(study.id)
    return summarize_study(store, study.id, base, ctx, stats, time.monotonic() - t0)


def _check_target(req: TuneRequest):  # noqa: ANN202 - a HardwareSpec
    """The run's hardware; SpecError for a hardware, space or fix the run cannot take (the cheap checks of
    `_prepare`)."""
    from advisor.hardware import get_hardware
    from search_spaces import apply_fixes, load_space

    hw = get_hardware(req.hardware)
    apply_fixes(load_space(req.space), req.fixes)
    return hw


def _inline(req: TuneRequest, hw) -> bool:  # noqa: ANN001 - a HardwareSpec
    """Whether this run's trials run inline (TuneRequest.executor): where they run one at a time on this host, a
    Ray would only cost its start (seconds of CPU across its processes) and its stop."""
    if req.executor != "auto":
        return req.executor == "inline"
    return req.ray_address is None and _concurrency(hw) == 1


class _Opening:
    """`_prepare`, then the store and the study opened and a killed run's trials in flight marked interrupted, in a
    thread of their own; `result()` waits for them and raises what they raised. A daemon thread: a run stopped
    meanwhile (SIGTERM) does not wait on the workload."""

    def __init__(self, req: TuneRequest, *, ahead: bool = False) -> None:
        self._req, self._out, self._error = req, None, None
        self._ahead: threading.Thread | None = None
        self._ahead_wanted = ahead
        self._thread = threading.Thread(target=self._run, daemon=True, name="advisor-tune-open")
        self._thread.start()

    def _run(self) -> None:
        from advisor.store import open_store

        try:
            wl, hw, space, context, base = _prepare(self._req)
            if self._ahead_wanted:  # beside the store and the study (a second): see `wait_ahead`
                self._ahead = threading.Thread(target=_feasibility_of, args=(self._req, hw, base), daemon=True,
                                               name="advisor-tune-ahead")
                self._ahead.start()
            store = open_store(self._req.db)
            study, ctx = _open_study(self._req, store, wl, hw, space, _objective(self._req, bool(wl.tokens_per_sample)))
            # at once, not once Ray is up: a killed run's trial in flight is marked before its orphaned actor
            # (Ray notices its driver's death within seconds) could finish it
            interrupted = store.mark_interrupted(study.id)
            self._out = (wl, hw, space, context, base, store, study, ctx, interrupted)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            self._error = exc

    def result(self):  # noqa: ANN201 - the tuple _run builds
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out

    def wait_ahead(self) -> float:
        """Wait for the baseline's memory estimate, made in the isolation worker while this process opened the
        store and the study and the first trial asks for it from the pruning's cache; the seconds waited. It
        ends before any trial starts: an estimate beside a trial would take a core from its measurement."""
        t0 = time.monotonic()
        if self._ahead is not None:
            self._ahead.join()
        return time.monotonic() - t0


def _feasibility_of(req: TuneRequest, hw, config) -> None:  # noqa: ANN001 - a HardwareSpec, a TrainingConfig
    """The pruning's decision on `config`, kept in its cache for the trial that asks next (trainable._measure's
    call, the same arguments); a failure here is that trial's to meet and record."""
    from search_spaces import feasibility

    try:
        feasibility(req.workload, req.workload_args, hw, config, req.margin, req.trial_budget.timeout_s / 2)
    except Exception:  # noqa: BLE001 - asked again by the trial, which records what it raises
        log.debug("the baseline's estimate ahead of its trial failed", exc_info=True)


def _search(req, hw, target, ctx: StudyContext, store, study, queued, remaining, on_result, *,
            inline: bool, held: set[int], ahead: Callable[[], float] | None = None) -> dict[str, Any]:
    """One experiment: the queued configurations (baseline, retries) first, then OptunaSearch over the space, one
    trial per suggestion, until the budget is spent. Under Ray (started by the caller) one Ray Tune experiment
    keeps one Ray actor (reuse_actors), and with it one fork server and one isolation worker, from the first
    trial to the last; `inline`, this process runs each trial in turn (`_run_inline`). `target` is (space,
    context, baseline); `held`, the ids of the study's trials finished before the run; `ahead()` waits for an
    estimate made ahead of the first trial (`_Opening.wait_ahead`): its wait counts as the estimates'."""
    from advisor.tune.ray_hooks import ProgressCallback
    from advisor.tune.searcher import MAX_REDRAWS, QueueThenSearch

    space, context, base = target
    _quiet_optuna()
    storage = _optuna_storage(ctx.db_url)
    _fail_stale(storage, study.optuna_study_name)
    budget = _Budget(remaining, req.patience, held)
    # leaders are measured again in the budget's last trials, not in a run that resumes with fewer left
    confirm = _Confirm(budget, min(req.resolved_confirm(), max(0, remaining - len(queued) - 1)), store, study.id,
                       ctx.metric)
    callback = ProgressCallback(budget, remaining, on_result)
    t = time.monotonic()

    def optuna_search():  # once the queued trials are in: the baseline becomes the screen's reference
        _seed_reference(storage, store, space, context, ctx, study, base)
        return _optuna_search(req, space, context, ctx, study, storage)

    multi = len(ctx.objective.metrics) > 1
    search = QueueThenSearch([c.model_dump_json() for c in queued], optuna_search,
                             metric=["objective", "memory"] if multi else "objective",
                             mode=["max", "min"] if multi else "max", confirm=None if multi else confirm)
    num_samples = len(queued) + remaining * DUPLICATE_FACTOR
    if ahead is not None:
        budget.estimate_s += ahead()
    try:
        if inline:
            _run_inline(req, ctx, budget, callback, search, num_samples)
        else:
            _fit(req, hw, ctx, _safe(study.name), budget, callback, search_alg=search, num_samples=num_samples)
        spent = (f"the sampler drew only configurations the run has results for, {MAX_REDRAWS} times in a row: the "
                 "space is spent")
        return {"search_s": time.monotonic() - t,
                "stopped_because": budget.reason or (spent if search.spent else "time or trial limit reached"),
                "trials_run": callback.count, "trial_s": budget.trial_s, "estimate_s": budget.estimate_s,
                "measured": budget.measured,
                "confirmed": budget.repeats, "redrawn": search.redrawn}
    finally:
        search.close()
        callback.close()


def _optuna_search(req: TuneRequest, space, context, ctx: StudyContext, study, storage):
    from ray.tune.search.optuna import OptunaSearch

    multi = len(ctx.objective.metrics) > 1
    return OptunaSearch(space=DefineByRun(space, context, ctx.owner),
                        metric=["objective", "memory"] if multi else "objective",
                        mode=["max", "min"] if multi else "max", sampler=_sampler(req),
                        study_name=study.optuna_study_name, storage=storage)  # the sampler carries the seed


def _run_inline(req: TuneRequest, ctx: StudyContext, budget: _Budget, callback, search, num_samples: int) -> None:
    """The experiment without Ray: each suggestion of `search` (a Ray Tune Searcher) evaluated in this process, in
    turn, and told back as Ray Tune would (the searcher's result, then the callback's, then the trial's end). As
    under Ray, user code runs in the isolation worker (the estimate) and in forked ranks (the trial), never here;
    a trial that raises is that trial's error, and the experiment goes on."""
    from ray.tune.search import Searcher

    for i in range(num_samples):
        if budget.done():
            return
        if req.time_budget_s is not None and time.monotonic() - budget.started >= req.time_budget_s:
            budget.reason = f"the time budget ({req.time_budget_s:g} s) is spent"
            return
        trial_id = f"inline_{i:05d}"
        suggested = search.suggest(trial_id)
        if suggested is None or suggested == Searcher.FINISHED:  # nothing in flight to wait for: the search is over
            return
        config = suggested.get("training_config")
        try:
            result = evaluate(ctx, config, repeat=bool(suggested.get("repeat")))
        except Exception:  # noqa: BLE001 - as a Ray trial's error: logged, told to the searcher, not the run's end
            log.exception("trial %s failed inside the tuner", trial_id)
            search.on_trial_complete(trial_id, error=True)
            continue
        search.on_trial_result(trial_id, result)
        callback.deliver(result, config)
        search.on_trial_complete(trial_id, result=result)


def _fit(req: TuneRequest, hw, ctx: StudyContext, name: str, budget: _Budget, callback, *, search_alg=None,
         num_samples: int = 1) -> None:
    """One Ray Tune experiment over the trainable; the budget stopper ends it early."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from advisor.tune.ray_hooks import BudgetStopper

    elapsed = None
    if req.time_budget_s is not None:
        elapsed = max(1.0, req.time_budget_s - (time.monotonic() - budget.started))
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(ray_trainable, ctx_json=ctx.model_dump_json()), _resources(hw)),
        tune_config=tune.TuneConfig(search_alg=search_alg, num_samples=num_samples, reuse_actors=True,
                                    max_concurrent_trials=_concurrency(hw), time_budget_s=elapsed),
        # a trial whose actor dies is that trial's error, never retried (user code runs in isolated workers)
        run_config=tune.RunConfig(name=name, storage_path=str(_results_dir()), verbose=0, stop=BudgetStopper(budget),
                                  callbacks=[callback, CSVLoggerCallback(), JsonLoggerCallback()],
                                  failure_config=tune.FailureConfig(max_failures=0)))
    tuner.fit()


def _concurrency(hw) -> int:
    return 1 if hw.device_type == "cpu" else hw.devices_per_node


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _results_dir() -> Path:
    from advisor.settings import get_settings

    path = get_settings().data_dir / "ray_results"
    path.mkdir(parents=True, exist_ok=True)
    return path
