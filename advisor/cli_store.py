"""`advisor db …` and `advisor results …`: parse, open the store, print. SQLAlchemy loads only when
one of these commands runs."""

from __future__ import annotations

import argparse
import json
import sys

from advisor.errors import SpecError


def _nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer; give a whole number >= 0") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative; give a whole number >= 0")
    return n


def join_dash_values(argv: list[str], flags: tuple[str, ...] = ("--sort",)) -> list[str]:
    """`--sort -samples_per_s` -> `--sort=-samples_per_s`: argparse would take the value for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv) and argv[i + 1].startswith("-") and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, metavar="URL",
                   help="database URL (default: ADVISOR_DATABASE_URL, else sqlite:///<data dir>/advisor.db)")


def add_parsers(sub: argparse._SubParsersAction, positive_int) -> None:  # noqa: ANN001 (argparse types)
    db = sub.add_parser("db", help="the result store's schema: upgrade it, show its revision")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    for name, text in (("upgrade", "create or upgrade the store's tables (Alembic)"),
                       ("current", "print the store's schema revision and the head this advisor ships")):
        _db_arg(db_sub.add_parser(name, help=text))

    res = sub.add_parser("results", help="query stored trials and best configurations")
    res_sub = res.add_subparsers(dest="results_command", required=True)
    ls = res_sub.add_parser("list", help="stored trials, filtered and sorted")
    for flag, text in (("--workload", "workload name or fingerprint (prefix of 8+)"),
                       ("--hardware", "hardware name or fingerprint (prefix of 8+)"),
                       ("--study", "study name or id")):
        ls.add_argument(flag, default=None, help=text)
    ls.add_argument("--status", action="append", default=[], help="a trial status; repeatable")
    ls.add_argument("--sort", default="id", help="a metric or id/started_at/finished_at; '-' prefix for descending")
    ls.add_argument("--limit", type=positive_int, default=50, help="at most this many rows (default 50)")
    ls.add_argument("--offset", type=_nonneg_int, default=0)
    show = res_sub.add_parser("show", help="one stored trial in full")
    show.add_argument("trial_id", type=positive_int, metavar="ID")
    best = res_sub.add_parser("best", help="the best configuration per workload, hardware and objective")
    best.add_argument("--workload", default=None)
    best.add_argument("--hardware", default=None)
    for p in (ls, show, best):
        _db_arg(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_export(res_sub, positive_int)

    from advisor import cli_recommend

    cli_recommend.add_parser(sub)


def _add_export(res_sub: argparse._SubParsersAction, positive_int) -> None:  # noqa: ANN001
    exp = res_sub.add_parser("export",
                             help="the stored best (or one trial) as JSON, a Python script or a torchrun command")
    exp.add_argument("--trial", type=positive_int, default=None, metavar="ID", help="export this trial")
    exp.add_argument("--workload", default=None, help="export the best of this workload (name or fingerprint)")
    exp.add_argument("--hardware", default=None, help="... on this hardware (name or fingerprint)")
    exp.add_argument("--format", default="json", help="json (default), python or torchrun")
    exp.add_argument("--out", default=None, metavar="FILE", help="write here instead of to stdout")
    _db_arg(exp)


def cmd_db(args: argparse.Namespace) -> int:
    from advisor.store.engine import describe, guarded, make_engine, resolve_url
    from advisor.store.migrate import current_revision, head_revision, upgrade

    url = resolve_url(args.db)
    engine = make_engine(url)
    try:
        with guarded(url):
            if args.db_command == "upgrade":
                print(f"{describe(url)}: at revision {upgrade(engine)} (head)")
                return 0
            with engine.connect() as conn:
                current = current_revision(conn)
        print(f"{describe(url)}: revision {current or 'none (empty)'}; this advisor's head: {head_revision()}")
        return 0
    finally:
        engine.dispose()


def _query(args: argparse.Namespace):  # noqa: ANN202
    from pydantic import ValidationError

    from advisor.store import TrialQuery

    try:
        return TrialQuery(workload=args.workload, hardware=args.hardware, study=args.study, status=tuple(args.status),
                          sort=args.sort, limit=args.limit, offset=args.offset)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "--" + str(err["loc"][0]) if err["loc"] else "a filter"
        if isinstance(err.get("input"), str):
            where += f" {err['input']!r}"
        raise SpecError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from exc


def cmd_results(args: argparse.Namespace) -> int:
    from advisor import render_results
    from advisor.store import open_store

    if args.results_command == "export":
        return _cmd_export(args)
    query = _query(args) if args.results_command == "list" else None
    with open_store(args.db) as store:
        if args.results_command == "list":
            trials = store.query_trials(query)
            if args.json:
                print(json.dumps([t.model_dump(mode="json") for t in trials], indent=2))
            else:
                render_results.trials_table(trials)
        elif args.results_command == "show":
            trial = store.get_trial(args.trial_id)
            if trial is None:
                raise SpecError(f"no trial with id {args.trial_id} in the store; `advisor results list` shows the ids")
            print(trial.model_dump_json(indent=2)) if args.json else render_results.trial_detail(trial)
        else:
            best = store.best(workload=args.workload, hardware=args.hardware)
            if args.json:
                print(json.dumps([b.model_dump(mode="json") for b in best], indent=2))
            else:
                render_results.best_table(best)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from advisor.export import FORMATS, export_stored
    from advisor.store import open_store

    if args.format not in FORMATS:  # before the store is opened (or created)
        raise SpecError(f"unknown export format {args.format!r}; valid: {', '.join(FORMATS)}")
    if args.trial is not None and (args.workload or args.hardware):
        raise SpecError("give --trial ID or --workload/--hardware, not both")
    with open_store(args.db) as store:
        text = export_stored(store, args.format, trial_id=args.trial, workload=args.workload, hardware=args.hardware)
    if args.out is None:
        print(text, end="")
        return 0
    try:
        Path(args.out).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot write {args.out}: {exc.strerror or exc}") from exc
    print(f"wrote {args.format} to {args.out}", file=sys.stderr)
    return 0
