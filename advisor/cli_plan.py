"""`advisor plan`: parse the workload, hardware, node range, fixed knobs and prices, call
`advisor.plan.search.plan`, print the top plans as a table (or JSON). Nothing heavy loads until the command runs."""

from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING

from advisor.errors import SpecError

if TYPE_CHECKING:
    from advisor.plan.model import PlanResult

_NODES = re.compile(r"^(\d+)(?:-(\d+))?$")


def add_parser(sub: argparse._SubParsersAction, positive_int) -> None:  # noqa: ANN001 (argparse types)
    from advisor.finetune import add_finetune_args

    p = sub.add_parser("plan", help="the fastest (or cheapest) ways to train a decoder on GPUs: meshes, ZeRO, "
                       "micro-batches, checkpointing, pruned by memory and ranked by predicted step time")
    p.add_argument("--workload", "-w", required=True, help="decoder preset (llama-70b, gpt2-xl, decoder) or "
                   "path/to/file.py:build of a decoder")
    p.add_argument("--workload-arg", "-a", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the workload's build (JSON where it parses); repeatable")
    add_finetune_args(p)  # a fine-tune is planned data parallel only (docs/planner.md)
    p.add_argument("--hardware", "-H", action="append", required=True, metavar="H",
                   help="NAME:N (N devices on one node) or NAME:NxM (M nodes); with --nodes, NAME:N per node; "
                        "repeatable")
    p.add_argument("--nodes", default=None, metavar="A-B", help="plan each node count A..B and rank them together")
    p.add_argument("--global-batch-size", type=positive_int, default=None, metavar="N",
                   help="samples per optimizer step (default: about 1M tokens, a power of 2)")
    p.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                   help="hold a knob: dp, tp, pp, cp, dp_replicate, strategy, schedule, virtual_stages, microbatches, "
                        "micro_batch_size, grad_accum, checkpointing, precision, optimizer, offload, "
                        "sequence_parallel; repeatable")
    p.add_argument("--price", action="append", default=[], metavar="USD|H=USD",
                   help="USD per device-hour (of H, with several -H); ranks by cost per million tokens")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="plans to show (default 5)")
    p.add_argument("--json", action="store_true", help='print JSON ({"plans": [...], ...}) instead of a table')


def parse_nodes(text: str | None) -> tuple[int, int] | None:
    """'1-16' -> (1, 16), '4' -> (4, 4); SpecError saying what is allowed."""
    if text is None:
        return None
    match = _NODES.match(text.strip())
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not 1 <= first <= last:
        raise SpecError(f"--nodes {text!r} has no node count; give FIRST-LAST with 1 <= FIRST <= LAST (e.g. 1-16) "
                        "or one count")
    return first, last


def parse_price(pairs: list[str], hardware: list[str]) -> dict[str, float]:
    """['2.5'] (one -H) or ['h100-sxm=2.5', ...] -> {catalog name: USD per device-hour}."""
    from advisor.cli_recommend import parse_prices

    names = [h.partition(":")[0].strip().lower() for h in hardware]
    bare = [p for p in pairs if "=" not in p]
    if bare and (len(pairs) > 1 or len(set(names)) > 1):
        raise SpecError("--price without a hardware name applies to one -H only; with several, give "
                        "--price NAME=USD for each (e.g. --price h100-sxm=3.2)")
    return parse_prices([f"{names[0]}={bare[0]}"] if bare else pairs)


def cmd_plan(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from advisor.errors import invalid_input
    from advisor.finetune import cli_workload_args
    from advisor.hardware import check_hardware
    from advisor.plan.knobs import parse_fixes

    try:
        # what can be checked before the planner's import (torch, a second or more) is
        fixed, nodes, prices = parse_fixes(args.fix), parse_nodes(args.nodes), parse_price(args.price, args.hardware)
        for name in args.hardware:
            check_hardware(name)
        from advisor.plan.search import PlanRequest, plan

        request = PlanRequest(workload=args.workload, workload_args=cli_workload_args(args), hardware=args.hardware,
                              nodes=nodes, global_batch_size=args.global_batch_size, fixed=fixed, prices=prices,
                              top=args.top)
    except ValidationError as exc:
        raise invalid_input(exc, {"nodes": "--nodes", "prices": "--price"}) from exc
    from rich.console import Console

    with Console(stderr=True).status(f"planning {args.workload} on {', '.join(args.hardware)}"):
        result = plan(request)
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        plan_table(result)
    return 0


def plan_table(result: "PlanResult") -> None:
    from rich.table import Table

    from advisor.render import human_bytes
    from advisor.render_results import _console

    console = _console()
    priced = any(p.cost_per_million_tokens is not None for p in result.plans)
    title = (f"{result.workload}: {result.global_batch_size} samples ({result.tokens_per_step:,} tokens) per step, "
             f"ranked by {result.objective.value.replace('_', ' ')}" if result.fits else
             f"{result.workload}: no plan fits; the closest ({result.global_batch_size} samples per step)")
    table = Table(title=title)
    columns = ["hardware", "mesh", "strategy", "mbs x steps", "ckpt", "mem/device", "fits",
                                                   "step s", "tok/s/device", "mfu", "compute", "comm", "bubble",
                                                   "opt"] + (["$/M tok"] if priced else [])
    for col in columns:
        table.add_column(col, justify="left" if col in ("hardware", "mesh", "strategy", "ckpt") else "right")
    for p in result.plans:
        c, b = p.config, p.breakdown
        steps = f"{c.micro_batch_size} x {c.microbatches} mb" if c.pp > 1 else f"{c.micro_batch_size} x {c.grad_accum}"
        row = [p.hardware] + [
            _mesh(c), c.strategy.value + (f" hsdp {c.dp_replicate}" if c.dp_replicate > 1 else "")
            + (" +offload" if c.offload.value != "none" else ""), steps, c.checkpointing.value,
            human_bytes(p.memory_per_device_bytes), "[green]yes[/green]" if p.fits else "[red]no[/red]",
            f"{p.step_time_s:.2f}", f"{p.tokens_per_s_per_device:,.0f}", "-" if p.mfu is None else f"{p.mfu:.2f}",
            f"{b.compute_s:.2f}", f"{b.exposed_comm_s:.2f}", f"{b.bubble_s:.2f}", f"{b.optimizer_s:.2f}"]
        if priced:
            row.append("-" if p.cost_per_million_tokens is None else f"{p.cost_per_million_tokens:.3f}")
        table.add_row(*row)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    for line in result.what_would_fit:
        console.print(f"would fit: {line}")
    console.print(f"step times in seconds (comm: exposed); {result.considered} memory figures, {result.timed} "
                  f"steps predicted, {result.seconds:.1f} s")


def _mesh(c) -> str:  # noqa: ANN001 - a PlanConfig
    parts = [f"dp{c.dp}", f"tp{c.tp}", f"pp{c.pp}"] + ([f"cp{c.cp}"] if c.cp > 1 else [])
    if c.pp > 1:
        parts.append(c.schedule.value + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else ""))
    return " ".join(parts)
