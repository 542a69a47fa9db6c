"""Tables for people: estimates, the hardware catalog and the machine bench (rich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from advisor.estimate.model import MemoryEstimate
    from probes.bench_models import BenchResult


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def estimate_table(est: "MemoryEstimate") -> None:
    from rich.console import Console
    from rich.table import Table

    r = est.request
    title = (f"{est.workload} on {est.hardware} x{est.world_size}: batch {r.batch_size}, {r.precision.value}, "
             f"{r.optimizer.value}, {r.strategy.value}" + (", checkpointing" if r.checkpointing else "")
             + (", fused backward" if r.fused_backward else ""))
    table = Table(title=title, show_header=True)
    table.add_column("per device")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    parts = est.breakdown.model_dump()
    for name, value in parts.items():
        table.add_row(name.replace("_", " "), human_bytes(value), f"{100 * value / max(est.total_bytes, 1):.1f}%")
    table.add_section()
    table.add_row(f"total ({est.predicts})", human_bytes(est.total_bytes), "")
    table.add_row("live tensors peak", human_bytes(est.allocated_bytes), "")
    if est.runtime_bytes:
        table.add_row("CUDA context (outside allocator)", human_bytes(est.runtime_bytes), "")
    table.add_row("device memory (usable)", f"{human_bytes(est.device_memory_bytes)} ({human_bytes(est.usable_bytes)})", "")
    fit = "[green]fits[/green]" if est.fits else "[red]does not fit[/red]"
    table.add_row("verdict", fit, "")
    console = Console()
    console.print(table)
    by = ", ".join(f"{k} {v}" for k, v in est.max_batch_by_strategy.items())
    console.print(f"largest batch that fits: {est.max_batch_size}  (by strategy: {by})")
    if est.predicted_samples_per_s:
        console.print(f"roofline: {est.predicted_step_s * 1e3:.1f} ms/step, {est.predicted_samples_per_s:,.0f} samples/s "
                      f"({est.flops_per_step / 1e12:.2f} TFLOP per step)")
    console.print(f"{est.num_params:,} parameters; method: {est.method}; {est.seconds:.1f} s")
    for note in est.notes:
        console.print(f"note: {note}")


def hardware_table(catalog: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hardware catalog (dense peak TFLOP/s)")
    for col in ("name", "memory", "fp32", "tf32", "bf16", "fp16", "mem GB/s", "interconnect"):
        # names are what --hardware takes: never cut them
        table.add_column(col, justify="right" if col not in ("name", "interconnect") else "left", no_wrap=col == "name")
    for name, acc in sorted(catalog.items()):
        pk = acc.peak_tflops
        table.add_row(name, human_bytes(acc.memory_bytes), *(f"{pk[k]:g}" if k in pk else "-" for k in ("fp32", "tf32", "bf16", "fp16")),
                      f"{acc.memory_bandwidth_gbps:g}", f"{acc.interconnect} {acc.interconnect_gbps:g} GB/s")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped: wide enough that no column is cut
    console.print(table)


def bench_tables(result: "BenchResult") -> None:
    """`advisor probe --bench` as tables: matmuls, copies, the DataLoader curve, then notes."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    mm = Table(title=f"matmul (square, best of runs; {result.torch_threads} CPU threads)")
    for col in ("device", "dtype", "size", "reps/run", "s/run", "TFLOP/s"):
        mm.add_column(col, justify="left" if col in ("device", "dtype") else "right")
    for m in result.matmul:
        mm.add_row(m.device, m.dtype, str(m.size), str(m.reps), f"{m.seconds_per_run:.3f}", f"{m.tflops:.3f}")
    console.print(mm)
    bw = Table(title="bandwidth (GB/s = 1e9 B/s; 'copy' counts read + write)")
    for col in ("device", "kind", "tensor", "bytes counted", "GB/s"):
        bw.add_column(col, justify="left" if col in ("device", "kind") else "right")
    for c in [*result.memory, *result.host_to_device]:
        bw.add_row(c.device, c.kind, human_bytes(c.tensor_bytes), human_bytes(c.bytes_counted), f"{c.gb_per_s:.1f}")
    if result.host_to_device_note:
        bw.add_row("-", "host-to-device", "", "", result.host_to_device_note)
    console.print(bw)
    curve = result.loader
    dl = Table(title=f"DataLoader: {curve.workload}, batch {curve.batch_size}",
               caption=f"{curve.batches} batches planned per count after a first one; fewer where time ran out")
    for col in ("workers", "batches", "samples/s", "vs 0 workers"):
        dl.add_column(col, justify="right")
    base = curve.points[0].samples_per_s
    for p in curve.points:
        dl.add_row(str(p.workers), str(p.batches), f"{p.samples_per_s:,.0f}", f"{p.samples_per_s / base:.2f}x")
    console.print(dl)
    console.print(f"bench took {result.seconds:.1f} s (budget {result.budget_seconds:g} s of measuring)")
    for note in result.notes:
        console.print(f"note: {note}")
