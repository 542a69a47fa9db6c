#!/usr/bin/env python
"""The estimator against real CUDA peaks (docs/design.md: max_memory_allocated / max_memory_reserved), on
the GPU of the machine it runs on. Needs a CUDA GPU.

    python bench/estimate_accuracy_cuda.py [--out bench/results/accuracy-cuda.json] [--resume] [--budget-s N]

Per case: one `measure(mode='cuda')` run in a fresh process (the caching allocator is deterministic
for a fixed sequence of requests: identical runs give identical peaks) against
`estimate_memory(workload, 'local', ...)`: `allocated_bytes` vs max_memory_allocated, `total_bytes`
vs max_memory_reserved (its `predicts`), with the anchors of estimate_accuracy.py beside them and
PyTorch's MemTracker under FakeTensorMode on the CUDA device. Then the largest batch under a memory
cap: ours vs a bisection of measured reserved peaks.

The cases are the CPU grid's eight kinds of workload at the presets' own image sizes and sequence
lengths, with batch sizes that put the measured peaks at roughly 2-40 GB on an 80 GB card.
Estimates run in this process while the measurement of the same case runs in its child, so the
GPU and the host work at once. `--budget-s` stops starting new cases after that many seconds (a
lease on a GPU machine is short); `--resume` then carries on from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.estimate_accuracy import (  # noqa: E402
    GB,
    GOALS,
    MaxBatchCase,
    WorkloadCase,
    _apct,
    _atomic_write,
    _child,
    _gb,
    _md_table,
    _pct,
    anchor_accelerate,
    anchor_deepspeed,
    anchor_rule24,
    case_key,
    rel,
    source_fingerprint,
    with_unreached,
)

CUDA_WORKLOADS: list[WorkloadCase] = [
    WorkloadCase("CNN", "resnet18", {}, (64, 256)),
    WorkloadCase("ViT", "vit-b16", {}, (32, 128)),
    WorkloadCase("encoder", "bert-base", {"seq_len": 512}, (8, 32)),
    WorkloadCase("decoder", "gpt2-small", {"seq_len": 1024}, (4, 16)),
    WorkloadCase("recurrent", "lstm", {}, (128, 512)),
    WorkloadCase("recommender", "dlrm", {"rows": 1_000_000}, (4096, 32768)),
    WorkloadCase("U-Net", "unet", {}, (8, 32)),
    WorkloadCase("MLP", "mlp", {}, (4096, 32768)),
]
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd-momentum")
CUDA_MAX_BATCH: list[MaxBatchCase] = [
    MaxBatchCase("gpt2-small", {"seq_len": 1024}, "bf16", "adamw", 8 * 1024**3, 8),
    MaxBatchCase("resnet18", {}, "fp32", "sgd-momentum", 6 * 1024**3, 64),
]
ERROR_ROWS = [
    ("ours_vs_reserved", "ours (total) vs max_memory_reserved"),
    ("ours_vs_alloc", "ours (allocated) vs max_memory_allocated"),
    ("rule24_vs_reserved", "24 B/param rule vs reserved"),
    ("accelerate_vs_reserved", "accelerate estimate-memory (16 B/param) vs reserved"),
    ("deepspeed_vs_reserved", "DeepSpeed ZeRO-2 1-GPU model states (20 B/param) vs reserved"),
    ("memtracker_vs_reserved", "MemTracker (FakeTensorMode, cuda) vs reserved"),
    ("memtracker_vs_alloc", "MemTracker (FakeTensorMode, cuda) vs allocated"),
]
CUDA_GOALS = {"ours_vs_reserved": GOALS["ours_vs_rss"], "ours_vs_alloc": GOALS["ours_vs_alloc"]}


def memtracker_cuda(workload: str, args: dict[str, Any], batch: int, precision: str, optimizer: str) -> dict[str, Any]:
    """MemTracker's peak over build + 2 fake training steps with the model and batch on the CUDA device."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._pytree import tree_map

    from advisor.config import OptimizerKind, Precision
    from advisor.training import prepare, train_step
    from advisor.workload import load_workload

    t0 = time.perf_counter()
    wl = load_workload(workload, args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemTracker()
        with tracker:
            torch.manual_seed(0)
            with torch.device("cuda"):  # built there: moving fake parameters across devices is refused
                model = wl.build_model()
            ctx = prepare(model, wl.loss_fn, precision=Precision(precision), optimizer=OptimizerKind(optimizer),
                          device_type="cuda", fake=True)
            for _ in range(2):
                data = tree_map(lambda x: x.to("cuda") if isinstance(x, torch.Tensor) else x, wl.make_batch(batch))
                train_step(ctx, data)
                del data
                tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    return {"peak_bytes": sum(int(dev["Total"]) for dev in snap.values()), "seconds": time.perf_counter() - t0}


def estimate_fields(wc: WorkloadCase, precision: str, optimizer: str, batch: int) -> dict[str, Any]:
    """Our estimate of one case for the local GPU, as the record's fields (a `problems` list on failure).
    Runs in this process or in a worker of --jobs: the estimate traces on the host's CPU only."""
    import logging

    from advisor.estimate import EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    logging.getLogger("advisor").setLevel(logging.ERROR)
    try:
        est = estimate_memory(wc.workload, get_hardware("local"),
                              EstimateRequest(batch_size=batch, precision=precision, optimizer=optimizer),
                              workload_args=wc.args)
    except Exception as exc:  # noqa: BLE001 - record and go on
        return {"problems": [f"estimate: {type(exc).__name__}: {exc}"]}
    return dict(est_total_bytes=est.total_bytes, est_allocated_bytes=est.allocated_bytes, method=est.method,
                predicts=est.predicts, num_params=est.num_params, est_seconds=est.seconds,
                est_runtime_bytes=est.runtime_bytes, breakdown=est.breakdown.model_dump(), problems=[])


def new_record(wc: WorkloadCase, precision: str, optimizer: str, batch: int) -> dict[str, Any]:
    return {"key": case_key(wc, precision, optimizer, batch), "kind": wc.kind, "workload": wc.workload,
            "workload_args": wc.args, "precision": precision, "optimizer": optimizer, "batch_size": batch,
            "errors": {}, "problems": []}


def measure_fields(wc: WorkloadCase, precision: str, optimizer: str, batch: int,
                   pool: ThreadPoolExecutor) -> dict[str, Any]:
    """The measured peaks of one case (a fresh process on the GPU) and MemTracker's (another), at once."""
    from advisor.measure import MeasureRequest, measure

    req = MeasureRequest(workload=wc.workload, workload_args=wc.args, batch_size=batch, precision=precision,
                         optimizer=optimizer, mode="cuda")
    real_f = pool.submit(measure, req)
    mt_f = pool.submit(_child_memtracker, wc, batch, precision, optimizer)
    out: dict[str, Any] = {"problems": []}
    try:
        out["memtracker_bytes"] = mt_f.result()["peak_bytes"]
    except Exception as exc:  # noqa: BLE001
        out["problems"].append(f"memtracker: {exc}")
    try:
        real = real_f.result()
        out.update(alloc_bytes=real.alloc_peak_bytes, reserved_bytes=real.cuda_reserved_bytes,
                   context_bytes=real.cuda_context_bytes)
    except Exception as exc:  # noqa: BLE001
        out["problems"].append(f"measure: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return out


MEASURED_FIELDS = ("memtracker_bytes", "alloc_bytes", "reserved_bytes", "context_bytes")


def score(rec: dict[str, Any]) -> dict[str, Any]:
    """The record's errors: ours, the anchors and MemTracker against the measured peaks."""
    p = rec.get("num_params")
    anchors = {"rule24": anchor_rule24(p), "accelerate": anchor_accelerate(p),
               "deepspeed": anchor_deepspeed(p)} if p else {}
    res, alloc = rec.get("reserved_bytes"), rec.get("alloc_bytes")
    e = rec["errors"] = {}
    e["ours_vs_reserved"] = rel(rec.get("est_total_bytes"), res)
    e["ours_vs_alloc"] = rel(rec.get("est_allocated_bytes"), alloc)
    for name, val in anchors.items():
        e[f"{name}_vs_reserved"] = rel(val, res)
    e["memtracker_vs_reserved"] = rel(rec.get("memtracker_bytes"), res)
    e["memtracker_vs_alloc"] = rel(rec.get("memtracker_bytes"), alloc)
    return rec


def run_case(wc: WorkloadCase, precision: str, optimizer: str, batch: int, pool: ThreadPoolExecutor,
             estimate: Future | None = None) -> dict[str, Any]:
    """Measure one case while its estimate runs (here, or already submitted to a worker: `estimate`)."""
    rec = new_record(wc, precision, optimizer, batch)
    t0 = time.perf_counter()
    if estimate is None:
        measured_f = pool.submit(measure_fields, wc, precision, optimizer, batch, pool)
        est = estimate_fields(wc, precision, optimizer, batch)
        measured = measured_f.result()
    else:
        measured = measure_fields(wc, precision, optimizer, batch, pool)
        est = estimate.result()
    rec.update({k: v for k, v in est.items() if k != "problems"},
               **{k: v for k, v in measured.items() if k != "problems"})
    rec["problems"] = est["problems"] + measured["problems"]
    rec["seconds"] = time.perf_counter() - t0
    return score(rec)


def _child_memtracker(wc: WorkloadCase, batch: int, precision: str, optimizer: str) -> dict[str, Any]:
    payload = dict(workload=wc.workload, args=wc.args, batch=batch, precision=precision, optimizer=optimizer)
    return _child("memtracker-cuda", payload, 600.0, script=Path(__file__).resolve())


def run_max_batch(mc: MaxBatchCase, hw) -> dict[str, Any]:
    """Ours under a cap (the device's memory set to it, margin 0) vs a bisection of measured reserved peaks."""
    from advisor.errors import TrialError
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.measure import MeasureRequest, measure

    t0 = time.perf_counter()
    # memory_per_device_bytes is a property of the accelerator's memory: cap that (model_copy would
    # set a property's name without effect)
    capped = hw.model_copy(update={"accelerator": hw.accelerator.model_copy(update={"memory_bytes": mc.cap_bytes})})
    est = estimate_memory(mc.workload, capped,
                          EstimateRequest(batch_size=mc.hint, precision=mc.precision, optimizer=mc.optimizer),
                          EstimateOptions(margin=0.0), workload_args=mc.args)
    rec: dict[str, Any] = {"workload": mc.workload, "workload_args": mc.args, "precision": mc.precision,
                           "optimizer": mc.optimizer, "cap_bytes": mc.cap_bytes, "ours": est.max_batch_size,
                           "notes": est.notes, "estimate_seconds": est.seconds, "probes": {}, "problems": []}
    # What runs out on a GPU is reserved memory plus the context outside the allocator. The estimate
    # fits total + runtime into the cap; the bisection holds measured reserved peaks to the same
    # room (the cap less the estimate's runtime), so the two answer one question.

    def peak(b: int) -> float:
        """Measured reserved peak at b; a run that fails (CUDA out of memory past the card) does not fit."""
        if str(b) not in rec["probes"]:
            try:
                r = measure(MeasureRequest(workload=mc.workload, workload_args=mc.args, batch_size=b,
                                           precision=mc.precision, optimizer=mc.optimizer, mode="cuda"))
                rec["probes"][str(b)] = int(r.cuda_reserved_bytes)
            except TrialError as exc:
                rec["probes"][str(b)] = None
                rec["problems"].append(f"batch {b}: {exc}")
        got = rec["probes"][str(b)]
        return float("inf") if got is None else got

    limit = est.usable_bytes - est.runtime_bytes
    rec["limit_bytes"] = limit
    lo, hi = 0, None
    b = max(1, rec["ours"] or mc.hint)
    if peak(b) <= limit:
        lo = b
        while hi is None:
            b = max(b + 1, int(b * 1.25))
            if peak(b) <= limit:
                lo = b
            else:
                hi = b
    else:
        hi = b
        while lo == 0 and b > 1:
            b = max(1, int(b * 0.8))
            if peak(b) <= limit:
                lo = b
            else:
                hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= limit:
            lo = mid
        else:
            hi = mid
    rec.update(real=lo, ratio=(rec["ours"] / lo) if lo else None, seconds=time.perf_counter() - t0)
    rec["goal_met"] = rec["ratio"] is not None and 0.9 <= rec["ratio"] <= 1.0
    return rec


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, label in ERROR_ROWS:
        signed = [c["errors"][key] for c in cases if c["errors"].get(key) is not None]
        vals = [abs(x) for x in signed]
        row: dict[str, Any] = {"label": label, "n": len(vals), "median_abs": statistics.median(vals) if vals else None,
                               "max_abs": max(vals) if vals else None,
                               "median_signed": statistics.median(signed) if signed else None}
        if key in CUDA_GOALS:
            row["goal_median"], row["goal_max"] = CUDA_GOALS[key]
            row["met"] = bool(vals) and row["median_abs"] <= row["goal_median"] and row["max_abs"] <= row["goal_max"]
        out[key] = row
    return out


COLUMNS = ["workload", "prec", "opt", "batch", "params (M)", "reserved GB", "allocated GB", "ours total GB",
           "ours vs reserved", "ours alloc GB", "ours vs alloc", "24 B/p", "accelerate", "DeepSpeed",
           "MemTracker vs alloc"]


def case_row(c: dict[str, Any]) -> list[str]:
    e = c["errors"]
    args = ",".join(f"{k}={v}" for k, v in c["workload_args"].items())
    return [c["workload"] + (f" ({args})" if args else ""), c["precision"], c["optimizer"], str(c["batch_size"]),
            f"{c['num_params'] / 1e6:.1f}" if c.get("num_params") else "—", _gb(c.get("reserved_bytes")),
            _gb(c.get("alloc_bytes")), _gb(c.get("est_total_bytes")), _pct(e.get("ours_vs_reserved")),
            _gb(c.get("est_allocated_bytes")), _pct(e.get("ours_vs_alloc")), _pct(e.get("rule24_vs_reserved")),
            _pct(e.get("accelerate_vs_reserved")), _pct(e.get("deepspeed_vs_reserved")),
            _pct(e.get("memtracker_vs_alloc"))]


def _kept_note(cases: list[dict[str, Any]]) -> list[str]:
    """A line saying which cases' measured peaks come from an earlier run (--reestimate), if any."""
    kept: dict[str, int] = {}
    for c in cases:
        if c.get("measured_in"):
            kept[c["measured_in"]] = kept.get(c["measured_in"], 0) + 1
    if not kept:
        return []
    runs = "; ".join(f"{n} measured in the run of {when}" for when, n in kept.items())
    rest = len(cases) - sum(kept.values())
    return [f"Estimated again in this run with the current code (`--reestimate`); measured peaks kept from an earlier "
            f"run on the same kind of GPU, where the caching allocator's peaks are deterministic: {runs}"
            + (f"; {rest} measured in this run." if rest else "."), ""]


def write_markdown(path: Path, res: dict[str, Any]) -> None:
    meta = res["meta"]
    srows = []
    for key, _ in ERROR_ROWS:
        s = res["summary"][key]
        goal = f"median ≤ {s['goal_median'] * 100:.0f}%, max ≤ {s['goal_max'] * 100:.0f}%" if "goal_median" in s else ""
        srows.append([s["label"], str(s["n"]), _apct(s["median_abs"]), _apct(s["max_abs"]), _pct(s["median_signed"]),
                      goal, ("yes" if s["met"] else "NO") if "met" in s else ""])
    parts = [
        "# Estimator accuracy on CUDA (bench/estimate_accuracy_cuda.py)", "",
        "## Estimator accuracy on CUDA", "",
        f"Run {meta['started']} on {meta['device']} (driver {meta['driver']}, torch {meta['torch']}, Python "
        f"{meta['python']}), hardware 'local' = {meta['hardware']}, {len(res['cases'])} of {meta['planned_cases']} "
        f"cases{'' if meta.get('finished') else ' (stopped early: the lease ran out)'}. advisor git "
        f"{meta['source']['git_head']} (sha256 {meta['source']['sha256']}).", "",
        *_kept_note(res["cases"]),
        "Measured: one fresh process per case, `reset_peak_memory_stats()` before the build, peaks over 3 optimizer "
        "steps (docs/design.md). Ours: `estimate_memory` for hardware 'local' at the case's batch, precision and "
        "optimizer, no real run. "
        "Relative error = (estimate − measured) / measured.", "",
        _md_table(["comparison", "n", "median |err|", "max |err|", "median (signed)", "goal", "met"], srows), "",
        _md_table(COLUMNS, [case_row(c) for c in res["cases"]]), "",
    ]
    ctx = [c["context_bytes"] for c in res["cases"] if c.get("context_bytes")]
    ours_rt = {c["est_runtime_bytes"] for c in res["cases"] if c.get("est_runtime_bytes")}
    if ctx:
        parts += [f"CUDA context and libraries outside the allocator (NVML's figure for the process less "
                  f"memory_reserved, after the steps): median {statistics.median(ctx) / 2**20:.0f} MiB, range "
                  f"{min(ctx) / 2**20:.0f}-{max(ctx) / 2**20:.0f} MiB over {len(ctx)} cases; the estimator adds "
                  + ", ".join(f"{x / 2**20:.0f} MiB" for x in sorted(ours_rt)) + " for it.", ""]
    probs = [(c["key"], p) for c in res["cases"] for p in c.get("problems", [])]
    if probs:
        parts += ["Problems:", ""] + [f"- `{k}`: {p}" for k, p in probs] + [""]
    if res.get("max_batch"):
        rows = [[m["workload"] + "".join(f" ({k}={v})" for k, v in m["workload_args"].items()), m["precision"],
                 m["optimizer"], _gb(m["cap_bytes"]), str(m.get("ours", "—")), str(m.get("real", "—")),
                 "—" if m.get("ratio") is None else f"{m['ratio']:.3f}", "yes" if m.get("goal_met") else "NO"]
                for m in res["max_batch"]]
        parts += ["Largest batch under a cap (the device's memory set to the cap, margin 0) against a bisection of "
                  "measured max_memory_reserved ≤ the estimate's usable memory (the cap less the CUDA context)"
                  + (f" ({meta['max_batch_note']})" if meta.get("max_batch_note") else "") + ":", "",
                  _md_table(["workload", "prec", "opt", "cap GB", "ours", "real", "ours / real", "0.9-1.0"], rows), ""]
    _atomic_write(path, "\n".join(parts))


@contextmanager
def _estimators(jobs: int):
    """A pool of `jobs` fresh worker processes for estimates (spawned: no CUDA state inherited), or None."""
    if jobs <= 0:
        yield None
        return
    import multiprocessing as mp

    threads = max(1, (len(os.sched_getaffinity(0)) - 2) // jobs)  # two CPUs left to the measuring children
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_threads,
                             initargs=(threads,)) as workers:
        yield workers


def _worker_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "accuracy-cuda.json")
    ap.add_argument("--resume", action="store_true", help="keep the cases already in --out and run only the rest")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: accuracy, maxbatch")
    ap.add_argument("--reestimate", action="store_true", help="with --resume: estimate the kept cases again with "
                    "the current code; their measured peaks stay (identical runs give identical CUDA peaks)")
    ap.add_argument("--jobs", type=int, default=0, help="estimate in this many worker processes, ahead of the "
                    "measurements (0: each estimate beside its own measurement, in this process)")
    ap.add_argument("--only", default=None, help="comma-separated workload names: with --resume --reestimate, estimate "
                    "only these again (the other kept cases stay as they are)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out and print it")
    ap.add_argument("--child-memtracker-cuda", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_memtracker_cuda:
        print(json.dumps(memtracker_cuda(**json.loads(args.child_memtracker_cuda))))
        return 0
    if args.render_only:
        res = json.loads(args.out.read_text())
        res["summary"] = summarize(res["cases"])
        write_markdown(args.out.with_suffix(".md"), res)
        print(args.out.with_suffix(".md").read_text())
        return 0

    import logging

    import torch

    from advisor.hardware import get_hardware

    logging.getLogger("advisor").setLevel(logging.ERROR)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this bench measures CUDA peaks and needs one", file=sys.stderr)
        return 2
    hw = get_hardware("local")
    t_start = time.perf_counter()
    skip = set(args.skip.split(","))
    plan = [(wc, prec, opt, wc.batches[bi]) for bi in range(2) for prec in PRECISIONS for opt in OPTIMIZERS
            for wc in CUDA_WORKLOADS] if "accuracy" not in skip else []
    import pynvml

    pynvml.nvmlInit()
    res: dict[str, Any] = {
        "meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                 "device": torch.cuda.get_device_name(0), "driver": pynvml.nvmlSystemGetDriverVersion(),
                 "torch": torch.__version__, "python": platform.python_version(), "hardware": hw.accelerator.name,
                 "planned_cases": len(plan), "source": source_fingerprint(), "finished": False},
        "cases": [], "summary": {}, "max_batch": [],
    }
    only = set(args.only.split(",")) if args.only else None
    done: dict[str, dict[str, Any]] = {}
    prev_run = None
    if args.resume and args.out.exists():
        prev = json.loads(args.out.read_text())
        done = {c["key"]: c for c in prev["cases"]
                if c.get("reserved_bytes") and (c.get("est_total_bytes") or args.reestimate)}
        prev_run = f"{prev['meta']['started']} (torch {prev['meta']['torch']})"
        res["max_batch"] = [m for m in prev.get("max_batch", []) if m.get("real")]
        if "accuracy" in skip:  # the cases stay as they were; only the parts run now change
            res["cases"], res["meta"] = prev["cases"], {**prev["meta"], "source": res["meta"]["source"]}
    md = args.out.with_suffix(".md")

    def save() -> None:
        cases = with_unreached(res["cases"], done)
        res["summary"] = summarize(cases)
        _atomic_write(args.out, json.dumps({**res, "cases": cases}, indent=1, default=str))
        write_markdown(md, {**res, "cases": cases})

    def out_of_time() -> bool:
        return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s

    stopped = False
    # the measurement, MemTracker (each in a child) and the thread waiting on both
    with ThreadPoolExecutor(max_workers=3) as pool, _estimators(args.jobs) as workers:
        # --jobs: every estimate the plan needs is submitted at once to worker processes (the host's
        # CPUs trace while the GPU measures); without it each runs here beside its measurement
        ahead: dict[str, Future] = {}

        def kept(wc: WorkloadCase, key: str) -> bool:  # kept as measured and estimated before
            return key in done and (not args.reestimate or (only is not None and wc.workload not in only))

        if workers is not None:
            for wc, prec, opt, b in plan:
                key = case_key(wc, prec, opt, b)
                if not kept(wc, key):
                    ahead[key] = workers.submit(estimate_fields, wc, prec, opt, b)
        for i, (wc, prec, opt, b) in enumerate(plan):
            key = case_key(wc, prec, opt, b)
            if kept(wc, key):
                res["cases"].append(done[key])
                continue
            if out_of_time():
                stopped = True
                break
            if key in done:  # measured peaks kept (the caching allocator's are deterministic); estimated again
                rec = {k: v for k, v in done[key].items() if k in MEASURED_FIELDS or k in new_record(wc, prec, opt, b)}
                est = ahead[key].result() if key in ahead else estimate_fields(wc, prec, opt, b)
                rec.update({k: v for k, v in est.items() if k != "problems"}, problems=est["problems"])
                rec["measured_in"] = done[key].get("measured_in", prev_run)
                rec = score(rec)
            else:
                rec = run_case(wc, prec, opt, b, pool, ahead.get(key))
            res["cases"].append(rec)
            e = rec["errors"]
            print(f"[{i + 1}/{len(plan)}] {wc.workload} {prec} {opt} b={b}: reserved {_gb(rec.get('reserved_bytes'))} "
                  f"GB, ours {_gb(rec.get('est_total_bytes'))} ({_pct(e.get('ours_vs_reserved'))}); allocated "
                  f"{_gb(rec.get('alloc_bytes'))}, ours {_pct(e.get('ours_vs_alloc'))}; MemTracker "
                  f"{_pct(e.get('memtracker_vs_alloc'))}"
                  + (f"; {rec['seconds']:.0f} s" if "seconds" in rec else "; measured peaks kept")
                  + (f"; problems: {'; '.join(rec['problems'])}" if rec["problems"] else ""), flush=True)
            save()
        for f in ahead.values():
            f.cancel()
    have = {(m["workload"], m["precision"]) for m in res["max_batch"]}
    for mc in ([] if "maxbatch" in skip else CUDA_MAX_BATCH):
        if (mc.workload, mc.precision) in have or out_of_time():
            stopped = stopped or (mc.workload, mc.precision) not in have
            continue
        try:
            m = run_max_batch(mc, hw)
        except Exception as exc:  # noqa: BLE001
            m = {"workload": mc.workload, "workload_args": mc.args, "precision": mc.precision,
                 "optimizer": mc.optimizer,
                 "cap_bytes": mc.cap_bytes, "problems": [f"{type(exc).__name__}: {exc}"]}
        res["max_batch"].append(m)
        print(f"max batch {mc.workload} under {mc.cap_bytes / GB:.2f} GB: ours {m.get('ours')}, real {m.get('real')}, "
              f"ratio {m.get('ratio')}", m.get("problems") or "", flush=True)
        save()
    res["meta"]["finished"] = not stopped
    res["meta"]["seconds"] = time.perf_counter() - t_start
    save()
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
