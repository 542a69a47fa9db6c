"""The `advisor` command line. Parses input, calls the service functions, prints tables or JSON.

User mistakes print one line (what was wrong, what is allowed) and exit 2; nothing heavy is
imported until a subcommand needs it, so `advisor --help` is fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from advisor import cli_plan, cli_recommend
from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy, choices
from advisor.errors import AdvisorError, ProbeError, SpecError, TrialError, WorkloadFailed
from advisor.finetune import add_finetune_args
from advisor.parallel.layout import PipelineSchedule

EXIT_USAGE = 2
EXIT_FAILED = 1  # the workload failed: crashed, hung, outgrew its memory cap, exited or raised


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + message)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _enum(enum_cls):
    def parse(value: str):
        try:
            return enum_cls(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not allowed; choose from {choices(enum_cls)}") from None

    parse.__name__ = enum_cls.__name__.lower()
    return parse


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer; give a positive whole number") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} is not positive; give a positive whole number")
    return n


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", "-w", required=True,
                   help="preset name (e.g. gpt2-small), path/to/file.py:build or pkg.module:build")
    p.add_argument("--workload-arg", "-a", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the workload's build (JSON where it parses); repeatable")
    p.add_argument("--hardware", "-H", default="local",
                   help="catalog name[:devices[xnodes]] (e.g. h100-sxm:8), 'cpu' or 'local'")
    add_finetune_args(p)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="advisor", description="Estimate, measure and tune PyTorch training configurations.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    est = sub.add_parser("estimate", help="per-device memory, fit and largest batch, without touching the device")
    _add_workload_args(est)
    est.add_argument("--batch-size", "-b", type=_positive_int, help="micro-batch per device (default: the workload's)")
    est.add_argument("--seq-len", type=_positive_int, help="sequence length, for workloads that take seq_len")
    est.add_argument("--precision", "-p", type=_enum(Precision), default=Precision.fp32,
                     help=f"one of {choices(Precision)}")
    est.add_argument("--optimizer", "-o", type=_enum(OptimizerKind), default=OptimizerKind.adamw,
                     help=f"one of {choices(OptimizerKind)}")
    est.add_argument("--strategy", "-s", type=_enum(Strategy), default=Strategy.single,
                     help=f"one of {choices(Strategy)}")
    est.add_argument("--optimizer-impl", choices=["for-loop", "foreach", "fused"], default=None)
    est.add_argument("--checkpointing", type=_enum(Checkpointing), nargs="?", const=Checkpointing.full,
                     default=Checkpointing.none, metavar="MODE",
                     help="activation checkpointing of the repeated blocks: none (default), selective (their attention "
                          "cores recomputed in backward) or full (their forwards recomputed; the flag alone)")
    est.add_argument("--fused-backward", action="store_true", help="optimizer step fused into backward")
    est.add_argument("--offload-optimizer", action="store_true", help="optimizer state and step on the host")
    est.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameters on the host")
    est.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (heads and FFN split)")
    est.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel ranks (layers cut into stages)")
    est.add_argument("--cp", type=_positive_int, default=1,
                     help="context-parallel ranks (each sequence split across them, attention in a ring)")
    est.add_argument("--dp-replicate", type=_positive_int, default=1,
                     help="HSDP: data-parallel groups (nodes), each sharding the model within itself (zero2/zero3)")
    est.add_argument("--schedule", type=_enum(PipelineSchedule), default=PipelineSchedule.one_f_one_b,
                     help=f"pipeline schedule: one of {choices(PipelineSchedule)}")
    est.add_argument("--microbatches", type=_positive_int, default=None,
                     help="micro-batches per step through the pipeline (default: its stages)")
    est.add_argument("--virtual-stages", type=_positive_int, default=1,
                     help="stages per pipeline rank (interleaved-1f1b)")
    est.add_argument("--stage-layers", type=_int_list, default=None, metavar="N,N,...",
                     help="layers of each pipeline stage, first to last (default: as even as the layers allow)")
    est.add_argument("--no-sequence-parallel", action="store_true",
                     help="with --tp: norms and residuals whole on every rank")
    est.add_argument("--grad-accum", type=_positive_int, default=1, metavar="N",
                     help="with a layout: batches whose gradients each optimizer step accumulates (default 1)")
    est.add_argument("--method", choices=["auto", "traced", "analytic"], default="auto")
    est.add_argument("--no-calibrate", action="store_true",
                     help="no short real run on this CPU, and no cuDNN workspace sized on this GPU")
    est.add_argument("--margin", type=float, default=None, help="fraction of device memory kept free (default 0.05)")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")

    trial = sub.add_parser("trial", help="measure one training configuration for real, in fresh processes")
    _add_workload_args(trial)
    trial.add_argument("--set", dest="knobs", action="append", default=[], metavar="KNOB=VALUE",
                       help="a TrainingConfig knob (batch_size, num_workers, precision, compile_mode, strategy, "
                            "nproc, tp, pp, pinning, ...); repeatable")
    trial.add_argument("--timeout", type=float, default=600.0, help="seconds before the trial is killed (default 600)")
    trial.add_argument("--memory-cap", default=None, help="CPU: oom past this resident set, e.g. 4GiB or 500MB")
    trial.add_argument("--warmup-steps", type=_positive_int, default=3)
    trial.add_argument("--min-steps", type=_positive_int, default=10)
    trial.add_argument("--min-time", type=float, default=2.0, help="seconds timed at least (default 2)")
    trial.add_argument("--settle", type=float, default=5.0, metavar="S",
                       help="wait up to S seconds for the machine to go quiet before starting (default 5; 0: at once)")
    trial.add_argument("--no-estimate", action="store_true", help="skip the estimator's prediction")
    trial.add_argument("--record-peak", choices=("auto", "always", "never"), default="auto",
                       help="CPU: after the trial, run docs/design.md's peak protocol once in a fresh process and "
                            "keep it as a measured peak that refines later estimates (auto: where the trial's peak, "
                            "measured or predicted, is 1/8 or more of its memory and no such peak lies near its batch; "
                            "default auto)")
    trial.add_argument("--json", action="store_true", help="print JSON instead of a table")

    sub.add_parser("workloads", help="list the built-in workload presets")
    hw = sub.add_parser("hardware", help="list the hardware catalog")
    hw.add_argument("--json", action="store_true")
    probe = sub.add_parser("probe", help="describe this machine: GPUs (NVML), CPUs, NUMA nodes, memory")
    probe.add_argument("--json", action="store_true", help="print JSON; with --bench: {\"probe\": ..., \"bench\": ...}")
    _add_bench_args(probe)

    from advisor import cli_serve, cli_store
    from advisor.tune import cli as tune_cli

    cli_store.add_parsers(sub, _positive_int)
    cli_serve.add_parsers(sub, _positive_int)
    tune_cli.add_parser(sub, _add_workload_args, _positive_int)
    cli_plan.add_parser(sub, _positive_int)
    return parser


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bench", action="store_true", help="also measure: matmul TFLOP/s, memory and host-to-device "
                   "GB/s, DataLoader samples/s over worker counts (~12 s)")
    p.add_argument("--bench-seconds", type=_positive_float, default=None, metavar="S",
                   help="measuring time for --bench (default 10; setup adds a few seconds); implies --bench")
    p.add_argument("--bench-workload", default=None, metavar="NAME",
                   help="workload whose dataset the DataLoader curve reads (default tiny-resnet); implies --bench")
    p.add_argument("--workload-arg", "-a", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the bench workload's build, e.g. decode_cost_ms=5; repeatable")


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number; give a positive number of seconds") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give a positive, finite number of seconds")
    return x


def _cmd_estimate(args: argparse.Namespace) -> int:
    from advisor.hardware import check_hardware

    check_hardware(args.hardware)  # before torch's import here and the workload's worker (seconds)
    from advisor import isolation
    from advisor.estimate import EstimateOptions, EstimateRequest
    from advisor.finetune import cli_workload_args
    from advisor.render import estimate_table

    wargs = cli_workload_args(args)
    if args.seq_len:
        wargs["seq_len"] = args.seq_len
    if args.margin is not None and not 0 <= args.margin < 1:
        raise SpecError(f"--margin {args.margin} is not allowed; give a fraction in [0, 1)")
    request = EstimateRequest.of(args.batch_size, precision=args.precision, optimizer=args.optimizer,
                                 strategy=args.strategy, checkpointing=args.checkpointing,
                                 fused_backward=args.fused_backward, offload_optimizer=args.offload_optimizer,
                                 offload_params=args.offload_params, optimizer_impl=args.optimizer_impl)
    if args.tp > 1 or args.pp > 1 or args.cp > 1 or args.dp_replicate > 1:
        return _estimate_layout(args, wargs, request)
    if args.grad_accum > 1:
        raise SpecError("--grad-accum applies to a layout estimate (--tp, --pp, --cp or --dp-replicate); one "
                        "device's estimate is of one micro-batch")
    options = EstimateOptions(calibrate=False if args.no_calibrate else None, margin=args.margin, method=args.method)
    from rich.console import Console

    from advisor.estimate.stages import listening

    # A spinner on stderr, saying which stage runs (tracing; on this CPU, calibration runs in fresh
    # processes and runs near the largest batch, up to minutes for a slow step); JSON stays clean.
    title = f"estimating {args.workload} on {args.hardware}"
    with Console(stderr=True).status(title) as spinner, listening(lambda stage: spinner.update(f"{title}: {stage}")):
        est = isolation.estimate(args.workload, args.hardware, request, options, workload_args=wargs)
    if args.json:
        print(est.model_dump_json(indent=2))
    else:
        estimate_table(est)
    return 0


def _estimate_layout(args: argparse.Namespace, wargs: dict, request: Any) -> int:
    """`advisor estimate` with --tp, --pp, --cp or --dp-replicate: per pipeline rank, on the hardware's devices
    (dp = the rest)."""
    from rich.console import Console

    from advisor import isolation
    from advisor.hardware import get_hardware
    from advisor.parallel.layout import layout_over
    from advisor.render_layout import layout_table

    hw = get_hardware(args.hardware)
    layout = layout_over(hw.world_size, tp=args.tp, pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate,
                         where=args.hardware, strategy=args.strategy,
                         schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages,
                         stage_layers=args.stage_layers, sequence_parallel=not args.no_sequence_parallel)
    title = f"estimating {args.workload} on {args.hardware} ({layout.label()})"
    with Console(stderr=True).status(title):
        est = isolation.estimate_layout(args.workload, hw, layout, request, workload_args=wargs, margin=args.margin,
                                        method=args.method, grad_accum=args.grad_accum)
    if args.json:
        print(est.model_dump_json(indent=2))
    else:
        layout_table(est)
    return 0


def _cmd_trial(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from advisor.errors import invalid_input
    from advisor.finetune import cli_workload_args
    from advisor.render import parse_bytes, trial_table
    from advisor.trial import TrialBudget, TrialStatus
    from advisor.workload import parse_workload_args
    from probes.runner import run_trial

    knobs = parse_workload_args(args.knobs, flag="--set")
    try:
        budget = TrialBudget(warmup_steps=args.warmup_steps, min_steps=args.min_steps, min_time_s=args.min_time,
                             timeout_s=args.timeout, record_peak=args.record_peak, settle_s=args.settle,
                             memory_cap_bytes=parse_bytes(args.memory_cap) if args.memory_cap else None)
    except ValidationError as exc:
        raise invalid_input(exc, {"min_time_s": "--min-time", "timeout_s": "--timeout", "settle_s": "--settle",
                                  "warmup_steps": "--warmup-steps", "min_steps": "--min-steps"}) from exc
    except ValueError as exc:  # --memory-cap that is not a size
        raise SpecError(str(exc).splitlines()[-1]) from exc
    from rich.console import Console

    with Console(stderr=True).status(f"measuring {args.workload} on {args.hardware} (warm-up, then timed steps)"):
        result = run_trial(args.workload, knobs, hardware=args.hardware,
                           workload_args=cli_workload_args(args), budget=budget, estimate=not args.no_estimate)
    if args.json:
        print(result.model_dump_json(indent=2))
    elif result.status == TrialStatus.invalid:  # refused before launching: a user's mistake, one line
        print(f"advisor trial: error: {result.error}", file=sys.stderr)
    else:
        trial_table(result)
    if result.status == TrialStatus.invalid:
        return EXIT_USAGE
    return 0 if result.ok else 1


def _cmd_workloads(args: argparse.Namespace) -> int:
    from advisor.presets import PRESETS

    for name in sorted(PRESETS):
        print(name)
    return 0


def _cmd_hardware(args: argparse.Namespace) -> int:
    from advisor.hardware import CATALOG, get_hardware
    from advisor.render import cpu_peak_lines, hardware_table

    if args.json:
        print(json.dumps({k: v.model_dump() for k, v in CATALOG.items()}, indent=2))
        return 0
    hardware_table(CATALOG)
    try:
        local = get_hardware("cpu")
    except ProbeError as err:  # the catalog stands on its own; say why this CPU is missing
        print(f"this machine's CPU: not probed ({err})")
        return 0
    print("'cpu' here (and 'local' without GPUs) is this machine's CPU; 'cpu:N' the catalog's:")
    print("\n".join(f"  {line}" for line in cpu_peak_lines(local)))
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from advisor.hardware import probe_local
    from advisor.hardware.probe import format_topology

    wants_bench = bool(args.bench or args.bench_seconds or args.bench_workload)
    if args.workload_arg and not wants_bench:
        raise SpecError("--workload-arg applies to the bench workload only; add --bench")
    probe = probe_local()
    bench = _run_bench(args) if wants_bench else None
    if args.json:
        if bench is None:
            print(probe.model_dump_json(indent=2))
        else:
            print(json.dumps({"probe": probe.model_dump(mode="json"), "bench": bench.model_dump(mode="json")},
                             indent=2))
        return 0
    if probe.note:
        print(probe.note)
    print(json.dumps(probe.model_dump(exclude={"gpus", "topology"}), indent=2, default=str))
    for gpu in probe.gpus:
        print(gpu)
    if probe.gpus:
        print(format_topology(probe))
    from advisor.hardware import hardware_from_host
    from advisor.render import bench_tables, cpu_peak_lines

    print("\n".join(cpu_peak_lines(hardware_from_host(probe))))
    if bench is not None:
        bench_tables(bench, probe.cpu.peak_tflops)
    return 0


def _run_bench(args: argparse.Namespace):
    from rich.console import Console

    from advisor.isolation import run_isolated
    from advisor.workload import parse_workload_args
    from probes.bench import DEFAULT_SECONDS, DEFAULT_WORKLOAD, run_bench

    workload = args.bench_workload or DEFAULT_WORKLOAD
    seconds = args.bench_seconds or DEFAULT_SECONDS
    # A spinner on stderr while measuring; stdout (JSON or tables) stays clean.
    # in an isolated worker: the bench workload's dataset is user code where it is a file or module
    with Console(stderr=True).status(f"measuring this machine (~{seconds:g} s): matmuls, copies, "
                                     f"DataLoader workers on {workload}"):
        return run_isolated(run_bench, workload, workload_args=parse_workload_args(args.workload_arg),
                            seconds=seconds, spec=workload, what="the machine bench", stage=f"loading {workload}")


def _cmd_tune(args: argparse.Namespace) -> int:
    from advisor.tune.cli import cmd_tune

    return cmd_tune(args)


def _cmd_db(args: argparse.Namespace) -> int:
    from advisor.cli_store import cmd_db

    return cmd_db(args)


def _cmd_results(args: argparse.Namespace) -> int:
    from advisor.cli_store import cmd_results

    return cmd_results(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from advisor.cli_serve import cmd_serve

    return cmd_serve(args)


def _cmd_worker(args: argparse.Namespace) -> int:
    from advisor.cli_serve import cmd_worker

    return cmd_worker(args)


COMMANDS = {"estimate": _cmd_estimate, "trial": _cmd_trial, "workloads": _cmd_workloads, "hardware": _cmd_hardware,
            "probe": _cmd_probe, "tune": _cmd_tune, "db": _cmd_db, "results": _cmd_results,
            "recommend": cli_recommend.cmd_recommend, "plan": cli_plan.cmd_plan, "serve": _cmd_serve,
            "worker": _cmd_worker}


def main(argv: Sequence[str] | None = None) -> int:
    from advisor.cli_store import join_dash_values

    args = _build_parser().parse_args(join_dash_values(list(sys.argv[1:] if argv is None else argv)))
    from advisor.log import setup_logging
    from advisor.settings import get_settings

    setup_logging(args.log_level or get_settings().log_level)
    try:
        return COMMANDS[args.command](args)
    except (WorkloadFailed, TrialError) as exc:  # the workload's code failed (in its isolated worker): not usage
        print(f"advisor {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except AdvisorError as exc:
        print(f"advisor {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("advisor: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `advisor ... | head`: the reader left; nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
