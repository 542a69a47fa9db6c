"""`advisor recommend`: parse the candidates and prices, call `advisor.recommend.recommend`, print a
table (or JSON) that names each row's provenance. Nothing heavy loads until the command runs."""

from __future__ import annotations

import argparse
import json

from advisor.errors import SpecError
from advisor.finetune import add_finetune_args


def add_parser(sub: argparse._SubParsersAction) -> None:  # noqa: ANN001 (argparse types)
    p = sub.add_parser("recommend", help="how to train a workload on each candidate hardware type, fastest (or "
                       "cheapest) per epoch first: measured, transferred, planned or estimated")
    p.add_argument("--workload", "-w", required=True, help="preset name, path/to/file.py:build or pkg.module:build")
    p.add_argument("--workload-arg", "-a", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the workload's build (JSON where it parses); repeatable")
    p.add_argument("--hardware", "-H", action="append", required=True, metavar="H",
                   help="a candidate: catalog name[:devices] (e.g. a100-80gb, h100-sxm:8); repeatable")
    p.add_argument("--price", action="append", default=[], metavar="H=USD",
                   help="price of one device of candidate H per hour (USD); ranks by cost per epoch; repeatable")
    p.add_argument("--db", default=None, metavar="URL",
                   help="database URL (default: ADVISOR_DATABASE_URL, else sqlite:///<data dir>/advisor.db)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_finetune_args(p)


def parse_prices(pairs: list[str]) -> dict[str, float]:
    """['a100-80gb=1.5', ...] -> {'a100-80gb': 1.5}; SpecError naming the bad pair."""
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, raw = pair.rpartition("=")
        try:
            price = float(raw)
        except ValueError:
            price = -1.0
        if not sep or not name.strip() or not 0 <= price < float("inf"):
            raise SpecError(f"--price {pair!r} is not HARDWARE=USD_PER_DEVICE_HOUR with a number >= 0 "
                            f"(e.g. a100-80gb=1.8)")
        out[name.strip()] = price
    return out


def cmd_recommend(args: argparse.Namespace) -> int:
    from advisor.finetune import cli_workload_args
    from advisor.isolation import run_isolated
    from advisor.recommend import check_candidates, recommend
    from advisor.render_results import recommend_table

    prices = parse_prices(args.price)
    check_candidates(args.hardware, prices)  # before the workload's worker starts (seconds)
    # the workload is loaded and estimated in an isolated worker, which opens the store itself
    recs = run_isolated(recommend, args.workload, args.hardware, workload_args=cli_workload_args(args),
                        db=args.db, prices=prices or None, spec=args.workload, what="the recommendation",
                        stage=f"loading {args.workload}")
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in recs], indent=2))
    else:
        recommend_table(args.workload, recs)
    return 0
