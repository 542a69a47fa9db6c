"""`advisor tune`: parse the search's inputs, run it with a live progress bar, print the top table."""

from __future__ import annotations

import argparse
import json
from typing import Any

from advisor.tune.request import EXECUTORS, SAMPLERS


def add_parser(sub: argparse._SubParsersAction, add_workload_args, positive_int) -> None:  # noqa: ANN001
    p = sub.add_parser("tune", help="search the knobs with measured trials (Optuna's samplers; Ray Tune for trials "
                                    "side by side or on a cluster); resumable")
    add_workload_args(p)
    p.add_argument("--space", default="quick", help="search space: quick, default, exhaustive, tiny, or a YAML file")
    p.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                   help="hold a knob at one value; repeatable")
    p.add_argument("--trials", type=positive_int, default=20, help="distinct configurations in the study (default 20)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="stop starting trials after S seconds")
    p.add_argument("--patience", type=positive_int, default=None, metavar="K",
                   help="stop after K measured trials without a better one")
    p.add_argument("--objective", choices=["throughput", "throughput,memory"], default="throughput",
                   help="maximize samples/s (tokens/s), or a throughput-memory Pareto front (NSGA-II)")
    p.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per optimizer step to keep fixed (gradient accumulation makes up the rest)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="default: tpe (each knob, and each pair known to interact, screened against the baseline, the "
                        "winners combined, then Optuna's multivariate TPE); tpe-plain: TPE alone; nsga2 for two "
                        "objectives; brute-force for 'exhaustive'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--study", default=None, help="study name (default: derived from the arguments, so a rerun resumes)")
    p.add_argument("--db", default=None, help="database URL (default: SQLite in the data dir; ADVISOR_DATABASE_URL)")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start one locally)")
    p.add_argument("--executor", choices=EXECUTORS, default="auto",
                   help="what runs the trials: ray (Ray Tune's trial runner, on a local Ray or --ray-address's "
                        "cluster) or inline (one at a time from this process, without Ray); auto (default): inline "
                        "where trials run one at a time on this host (a CPU, or one device per node), else ray")
    p.add_argument("--remeasure", action="store_true", help="measure again what the store already has")
    p.add_argument("--confirm", type=int, default=None, metavar="N",
                   help="trials of the budget kept to measure the leading configurations again, so that the best is "
                        "not one lucky run (default: trials // 8; 0: none)")
    p.add_argument("--min-time", type=float, default=2.0, metavar="S",
                   help="seconds timed per trial at least (default 2)")
    p.add_argument("--min-steps", type=positive_int, default=5, help="timed steps per trial at least (default 5)")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S", help="a trial is killed after S seconds")
    p.add_argument("--settle", type=float, default=5.0, metavar="S",
                   help="wait up to S seconds before each trial for the machine to go quiet (default 5; 0: start at "
                        "once, on a machine you know is busy and accept figures that may be low)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _request(args: argparse.Namespace):
    from pydantic import ValidationError

    from advisor.errors import invalid_input
    from advisor.finetune import cli_workload_args
    from advisor.trial import TrialBudget
    from advisor.tune.request import TuneRequest
    from search_spaces import parse_fixes

    try:
        budget = TrialBudget(warmup_steps=2, min_steps=args.min_steps, min_time_s=args.min_time,
                             timeout_s=args.trial_timeout, settle_s=args.settle)
        return TuneRequest(workload=args.workload, workload_args=cli_workload_args(args),
                           hardware=args.hardware, space=args.space, fixes=parse_fixes(args.fix),
                           objective=args.objective, global_batch_size=args.global_batch_size, sampler=args.sampler,
                           trials=args.trials, time_budget_s=args.time_budget, patience=args.patience, seed=args.seed,
                           study=args.study, db=args.db, ray_address=args.ray_address, executor=args.executor,
                           remeasure=args.remeasure,
                           confirm=args.confirm, trial_budget=budget)
    except ValidationError as exc:
        raise invalid_input(exc, {"confirm": "--confirm", "min_time_s": "--min-time", "timeout_s": "--trial-timeout",
                                  "settle_s": "--settle"}) from exc


def _describe(config_json: str | None) -> str:
    if not config_json:
        return "(no configuration)"
    from advisor.trial import TrainingConfig

    changes = TrainingConfig.model_validate_json(config_json).changes()
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "defaults"


def cmd_tune(args: argparse.Namespace) -> int:
    from advisor.hardware import check_hardware
    from advisor.isolation.pool import default_pool

    check_hardware(args.hardware)  # a mistyped name costs no fork server
    default_pool().warm()  # the workload loads in a worker of its fork server, whose imports (seconds) start first
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from advisor.tune.driver import run_tune
    from advisor.tune.render import summary_table

    req = _request(args)
    best: dict[str, Any] = {"value": None}
    console = Console(stderr=True)
    columns = (TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as progress:  # the table follows it
        task = progress.add_task("starting (the workload, the store, the baseline)", total=req.trials)

        def on_result(result: dict[str, Any], done: int, total: int) -> None:
            if result.get("status") == "ok" and (best["value"] is None or result["objective"] > best["value"]):
                best["value"] = result["objective"]
            shown = f"best {best['value']:,.1f}/s" if best["value"] is not None else "no result yet"
            progress.update(task, total=total, completed=done,
                            description=f"{shown} | last: {result.get('status')} {_describe(result.get('config'))}")

        summary = run_tune(req, on_result=on_result)
    if args.json:
        print(json.dumps(summary.model_dump(mode="json"), indent=2))
    else:
        summary_table(summary)
    return 0
