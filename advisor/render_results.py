"""Tables for stored results (rich): trial lists, one trial in full, best configurations."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from advisor.render import human_bytes

if TYPE_CHECKING:
    from advisor.recommend import Recommendation
    from advisor.store import BestRecord, TrialRecord


def _console():  # noqa: ANN202
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)  # piped: no column cut


def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(value: int | None) -> str:
    return "-" if value is None else human_bytes(value)


def _changes(t: "TrialRecord") -> str:
    knobs = {"batch_size": t.config.batch_size, **t.config.changes()}
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def trials_table(trials: list["TrialRecord"]) -> None:
    from rich.table import Table

    console = _console()
    if not trials:
        console.print("no stored trials match")
        return
    table = Table(title=f"{len(trials)} stored trial(s)")
    for col in ("id", "study", "workload", "hardware", "status", "samples/s", "tokens/s", "p50 ms", "peak mem",
                "predicted", "mfu", "bottleneck", "config"):
        table.add_column(col, justify="right" if col in ("id", "samples/s", "tokens/s", "p50 ms", "mfu") else "left",
                         no_wrap=col in ("id", "status"))
    for t in trials:
        status = t.status.value + (f" #{t.attempt}" if t.attempt > 1 else "")
        table.add_row(str(t.id), t.study_name, t.workload_name, t.hardware_name, status, _num(t.samples_per_s),
                      _num(t.tokens_per_s, "{:,.0f}"), _num(t.step_p50_s and t.step_p50_s * 1e3),
                      _bytes(t.peak_memory_bytes), _bytes(t.predicted_memory_bytes), _num(t.mfu, "{:.3f}"),
                      t.bottleneck or "-", _changes(t))
    console.print(table)


def trial_detail(t: "TrialRecord") -> None:
    from rich.table import Table

    table = Table(title=f"trial {t.id} of study {t.study_name}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows = [("workload", f"{t.workload_name} ({t.workload_fp[:12]})"),
            ("hardware", f"{t.hardware_name} ({t.hardware_fp[:12]})"),
            ("status", f"{t.status.value} (attempt {t.attempt})"), ("samples/s", _num(t.samples_per_s)),
            ("tokens/s", _num(t.tokens_per_s, "{:,.0f}")), ("step p50 / p90 (ms)",
             f"{_num(t.step_p50_s and t.step_p50_s * 1e3)} / {_num(t.step_p90_s and t.step_p90_s * 1e3)}"),
            ("peak memory", _bytes(t.peak_memory_bytes)), ("predicted memory", _bytes(t.predicted_memory_bytes)),
            ("data wait", _num(t.data_wait_fraction, "{:.1%}")), ("mfu", _num(t.mfu, "{:.3f}")),
            ("bottleneck", t.result.bottleneck.reason if t.result and t.result.bottleneck else t.bottleneck or "-"),
            ("config", json.dumps(t.config.model_dump(mode="json"), sort_keys=True)), ("config hash", t.config_hash),
            ("software", t.software_fp[:12]), ("started / finished", f"{t.started_at:%Y-%m-%d %H:%M:%S} / "
             + (f"{t.finished_at:%Y-%m-%d %H:%M:%S}" if t.finished_at else "-"))]
    if t.error:
        rows.append(("error", t.error))
    for field, value in rows:
        table.add_row(field, value)
    _console().print(table)


def best_table(best: list["BestRecord"]) -> None:
    from rich.table import Table

    console = _console()
    if not best:
        console.print("no best configurations stored")
        return
    table = Table(title="best configurations")
    for col in ("workload", "hardware", "objective", "trial", "samples/s", "peak mem", "config"):
        table.add_column(col, justify="right" if col in ("trial", "samples/s") else "left")
    for b in best:
        t = b.trial
        table.add_row(t.workload_name, t.hardware_name, b.objective, str(t.id), _num(t.samples_per_s),
                      _bytes(t.peak_memory_bytes), _changes(t))
    console.print(table)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.2f} s"


def recommend_table(workload: str, recs: list["Recommendation"]) -> None:
    """Candidates best first, each with its provenance, figures and the reason below the table."""
    from rich.table import Table

    console = _console()
    basis = "per dataset epoch" if recs and recs[0].epoch_basis == "dataset" else "per 1e6 samples (no dataset)"
    table = Table(title=f"recommendations for {workload} ({basis})")
    for col in ("#", "hardware", "provenance", "samples/s", "tokens/s", "peak mem", "time/epoch", "cost/epoch",
                "fits", "config"):
        table.add_column(col, justify="right" if col in ("#", "samples/s", "tokens/s", "cost/epoch") else "left")
    for i, r in enumerate(recs, 1):
        knobs = {"batch_size": r.config.batch_size, **r.config.changes()}
        table.add_row(str(i), r.hardware, r.provenance, _num(r.samples_per_s), _num(r.tokens_per_s, "{:,.0f}"),
                      _bytes(r.peak_memory_bytes), _duration(r.time_per_epoch_s), _num(r.cost_per_epoch, "${:,.4f}"),
                      "yes" if r.fits else "no", " ".join(f"{k}={v}" for k, v in knobs.items()))
    console.print(table)
    for i, r in enumerate(recs, 1):
        console.print(f"{i}. {r.hardware}: {r.reason}", highlight=False)
