"""The table `advisor tune` ends with: top configurations, speedup over the baseline, verdicts."""

from __future__ import annotations

from advisor.render import human_bytes
from advisor.tune.summary import RankedTrial, TuneSummary


def _knobs(rt: RankedTrial) -> str:
    c = rt.record.config
    changed = ", ".join(f"{k}={v}" for k, v in c.changes().items()) or "otherwise PyTorch defaults"
    return f"batch {c.batch_size}" + (f" x{c.grad_accum}" if c.grad_accum > 1 else "") + f"; {changed}"


def summary_table(s: TuneSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped: wide enough that the knobs column is not cut
    unit = "tokens/s" if s.metric == "tokens_per_s" else "samples/s"
    rows = s.pareto or s.top
    shown = "Pareto front, throughput vs memory" if s.pareto else "top configurations"
    title = f"study {s.study_name} (id {s.study_id}): {shown}"
    table = Table(title=title)
    for col, justify in (("#", "right"), ("trial", "right"), (unit, "right"), ("vs baseline", "right"),
                         ("peak memory", "right"), ("bottleneck", "left"), ("knobs (changed from defaults)", "left")):
        table.add_column(col, justify=justify)
    for i, rt in enumerate(rows, 1):
        r = rt.record
        runs = f" (mean of {rt.measurements})" if rt.measurements > 1 else ""
        table.add_row(str(i), str(r.id), f"{rt.value:,.1f}{runs}", f"{rt.speedup:.2f}x" if rt.speedup else "-",
                      human_bytes(r.peak_memory_bytes or 0), r.bottleneck or "-", _knobs(rt))
    console.print(table)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s.statuses.items()))
    console.print(f"trials in the study: {counts or 'none'}")
    if s.baseline is None:
        console.print("baseline (PyTorch defaults): not measured ok, so no speedup is shown")
    if s.trial_s:
        overhead = (s.wall_s - s.trial_s) / s.wall_s
        console.print(f"this run: {s.wall_s:.0f} s, of which {s.stats.get('measured', 0)} measured trials "
                      f"{s.trial_s:.0f} s (orchestration {overhead:.0%})")
        console.print(f"the rest: {_rest(s)}")
    else:
        console.print(f"this run: {s.wall_s:.0f} s, nothing new measured")
    for key in ("resumed_from", "interrupted", "retried"):
        if s.stats.get(key):
            console.print(f"{key.replace('_', ' ')}: {s.stats[key]}")
    if s.stats.get("planned"):
        console.print(f"run first after the baseline: the planner's {s.stats['planned']} fastest plans (advisor plan)")
    if s.stats.get("confirmed"):
        console.print(f"measured again to settle the leaders: {s.stats['confirmed']} trial(s); a configuration's "
                      "figure is the mean of its measurements")
    if s.stats.get("stopped_because"):
        console.print(f"stopped: {s.stats['stopped_because']}")
    if s.best is not None:
        console.print(f"export the best: advisor results export --trial {s.best.record.id} "
                      "--format python|json|torchrun")


def _rest(s: TuneSummary) -> str:
    """Where a run's time outside its measured trials went (s)."""
    start, estimates, stop = (s.stats.get(k, 0.0) for k in ("start_s", "estimate_s", "stop_s"))
    search = max(0.0, s.wall_s - s.trial_s - start - estimates - stop)
    if s.stats.get("executor") == "inline":
        return (f"start {start:.1f} s (loading the workload), memory estimates {estimates:.1f} s, "
                f"the search and the store {search:.1f} s")
    return (f"start {start:.1f} s (Ray beside loading the workload), memory estimates {estimates:.1f} s, "
            f"Ray Tune and the store {search:.1f} s, Ray's stop {stop:.1f} s")
