"""Tables for people: estimates, the hardware catalog and the machine bench (rich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from advisor.bench_result import BenchResult
    from advisor.estimate.model import MemoryEstimate
    from advisor.hardware.spec import HardwareSpec


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def estimate_table(est: "MemoryEstimate") -> None:
    from rich.console import Console
    from rich.table import Table

    from advisor.estimate.evaluator import MAX_BATCH_LIMIT

    r = est.request
    title = (f"{est.workload} on {est.hardware} x{est.world_size}: batch {r.batch_size}, {r.precision.value}, "
             f"{r.optimizer.value}, {r.strategy.value}"
             + (f", {r.checkpointing.value} checkpointing" if r.checkpointing else "")
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
        label = "CUDA context and NCCL buffers" if est.world_size > 1 and est.request.strategy.value != "single" \
            else "CUDA context"
        table.add_row(f"{label} (outside allocator)", human_bytes(est.runtime_bytes), "")
    table.add_row("device memory (usable)",
                  f"{human_bytes(est.device_memory_bytes)} ({human_bytes(est.usable_bytes)})", "")
    fit = "[green]fits[/green]" if est.fits else "[red]does not fit[/red]"
    table.add_row("verdict", fit, "")
    console = Console()
    console.print(table)

    def batch(n: int) -> str:  # the search stops at its limit: a larger batch may fit too
        return f">= {n}" if n >= MAX_BATCH_LIMIT else str(n)

    by = ", ".join(f"{k} {batch(v)}" for k, v in est.max_batch_by_strategy.items())
    console.print(f"largest batch that fits: {batch(est.max_batch_size)}  (by strategy: {by})")
    if est.predicted_samples_per_s:
        console.print(f"roofline: {est.predicted_step_s * 1e3:.1f} ms/step, "
                      f"{est.predicted_samples_per_s:,.0f} samples/s ({est.flops_per_step / 1e12:.2f} TFLOP per step)")
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
        peaks = (f"{pk[k]:g}" if k in pk else "-" for k in ("fp32", "tf32", "bf16", "fp16"))
        table.add_row(name, human_bytes(acc.memory_bytes), *peaks,
                      f"{acc.memory_bandwidth_gbps:g}", f"{acc.interconnect} {acc.interconnect_gbps:g} GB/s")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped: wide enough that no column is cut
    console.print(table)


def cpu_peak_lines(hw: "HardwareSpec") -> list[str]:
    """A probed CPU spec in words: what the CPU is, and how its peak TFLOP/s were derived (or why not)."""
    acc, cpu = hw.accelerator, hw.accelerator.cpu
    if cpu is None:
        return [f"{acc.name}: catalog figures, nothing probed"]
    where = f"{cpu.vendor} family {cpu.family} model {cpu.model}" if cpu.family is not None else cpu.vendor
    bf16 = f"bf16 via {cpu.bf16_unit}" if cpu.bf16_unit else "bf16 emulated"
    lines = [f"CPU: {cpu.model_name} ({where}; {cpu.microarchitecture}, {cpu.vector_isa}, {bf16})"]
    peaks = cpu.peak_tflops()
    if peaks is None:
        lines.append("derived peak: unknown; the catalog's nominal "
                     + ", ".join(f"{k} {v:g}" for k, v in acc.peak_tflops.items()) + " TFLOP/s stand in")
    else:
        lines.append(f"derived peak: {cpu.cores} cores ({cpu.cores_from}) x {cpu.clock_ghz:g} GHz "
                     f"({cpu.clock_source}) x {cpu.fp32_flop_per_cycle} fp32 / {cpu.bf16_flop_per_cycle} bf16 "
                     f"FLOP/cycle ({cpu.per_cycle_from}) = "
                     + ", ".join(f"{k} {v:.3g}" for k, v in peaks.items()) + " TFLOP/s")
    lines.append(f"memory bandwidth: {acc.memory_bandwidth_gbps:g} GB/s, the catalog's nominal figure (not derived)")
    return lines + ([f"note: {hw.note}"] if hw.note else [])


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '500MB', '1e9' or '123' -> bytes; SpecError saying what is allowed otherwise."""
    import re

    from advisor.errors import SpecError

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        value = float(match.group(1)) if match else -1.0
    except ValueError:
        value = -1.0
    if not match or unit not in _UNITS or value <= 0:
        raise SpecError(f"{text!r} is not a size; give a positive number with an optional unit "
                        f"({', '.join(u for u in ('KB', 'MB', 'GB', 'KiB', 'MiB', 'GiB'))}), e.g. 4GiB")
    return int(value * _UNITS[unit])


def trial_table(result) -> None:
    """One measured trial: status, throughput, times, memory against the estimate, verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    changed = ", ".join(f"{k}={v}" for k, v in result.config.changes().items()) or "PyTorch defaults"
    table = Table(title=f"trial: {result.workload} on {result.hardware} ({changed})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    colour = "green" if result.ok else "red"
    table.add_row("status", f"[{colour}]{result.status.value}[/{colour}]")
    if result.ok:
        table.add_row("samples/s", f"{result.samples_per_s:,.1f}")
        if result.tokens_per_s:
            table.add_row("tokens/s", f"{result.tokens_per_s:,.0f}")
        st = result.step_time_s
        table.add_row("step time p50 / p90", f"{st.p50 * 1e3:.1f} ms / {st.p90 * 1e3:.1f} ms")
        table.add_row("waiting for data", f"{result.data_wait_fraction:.1%}")
        table.add_row(f"peak memory ({'cuda reserved' if result.config.device == 'cuda' else 'cpu rss'})",
                      human_bytes(result.peak_memory_bytes or 0))
        if result.predicted_memory_bytes:
            peak = result.peak_memory_bytes or 0
            err = (result.predicted_memory_bytes - peak) / max(peak, 1)
            table.add_row("estimated", f"{human_bytes(result.predicted_memory_bytes)} ({err:+.1%})")
        if result.protocol_peak_bytes:  # the fresh-process peak the CPU estimate predicts (probes/protocol.py)
            line = human_bytes(result.protocol_peak_bytes)
            if result.predicted_memory_bytes:
                fresh = result.protocol_peak_bytes
                line += f" (estimate {(result.predicted_memory_bytes - fresh) / fresh:+.1%})"
            table.add_row("peak, fresh process", line)
        if result.mfu is not None:
            table.add_row("MFU", f"{result.mfu:.2%}")
        if result.compile_s is not None:
            table.add_row("compile", f"{result.compile_s:.1f} s")
        if result.others_busy is not None:  # how quiet the machine was (probes/runner.py _settle)
            table.add_row("CPU others took at start", f"{result.others_busy:.0%}")
        table.add_row("timed", f"{result.measured_steps} steps in {result.measured_s:.1f} s "
                               f"(warm-up {result.warmup_s:.1f} s, overhead {result.overhead_s:.1f} s)")
    console.print(table)
    if result.ranks:  # piped: wide enough that no column is cut
        (console if console.is_terminal else Console(width=120)).print(rank_table(result))
    if result.bottleneck:
        console.print(f"bottleneck: [bold]{result.bottleneck.verdict}[/bold]: {result.bottleneck.reason}")
    if result.error:
        from rich.text import Text

        console.print(Text(f"{result.status.value}: ", style="red") + Text(result.error))
    for note in result.notes:
        console.print(f"note: {note}")


def rank_table(result):  # noqa: ANN201 - a rich Table
    """Every rank of a tp/pp trial: its place in the mesh, its peak beside the per-rank estimate, and the payload
    bytes its collectives moved per optimizer step by kind (the estimate's in brackets)."""
    from rich.table import Table

    cuda = result.config.device == "cuda"
    table = Table(title="per rank (estimates in brackets)")
    for col in ("rank", "pp/dp/cp/tp", "peak reserved" if cuda else "peak rss", "allocated",
                "est. live", "est. total", "comm per step"):
        table.add_column(col, justify="left" if col == "comm per step" else "right")
    for r in result.ranks:
        peak = r.peak.cuda_reserved_bytes if cuda else r.peak.cpu_rss_bytes
        predicted = r.predicted_comm_bytes
        comm = [f"{k} {human_bytes(r.comm_bytes.get(k, 0))}"
                + (f" ({human_bytes(predicted.get(k, 0))})" if predicted is not None else "")
                for k in sorted({*r.comm_bytes, *(predicted or {})})]
        place = "/".join(str(r.coords.get(d, "-")) for d in ("pp", "dp", "cp", "tp"))
        table.add_row(str(r.rank), place, _or_dash(peak),
                      _or_dash(r.peak.cuda_allocated_bytes if cuda else r.peak.cpu_allocated_bytes),
                      _or_dash(r.predicted_allocated_bytes), _or_dash(r.predicted_total_bytes),
                      "\n".join(comm) or "-")
    return table


def _or_dash(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def bench_tables(result: "BenchResult", cpu_peaks: dict[str, float] | None = None) -> None:
    """`advisor probe --bench` as tables: matmuls (beside the CPU's derived peak TFLOP/s per dtype, where
    given), copies, the DataLoader curve, then notes."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    mm = Table(title=f"matmul (square, best of runs; {result.torch_threads} CPU threads)",
               caption="peak: the CPU's derived dense peak (advisor hardware / advisor probe show how)")
    for col in ("device", "dtype", "size", "reps/run", "s/run", "TFLOP/s", "peak", "of peak"):
        mm.add_column(col, justify="left" if col in ("device", "dtype") else "right")
    for m in result.matmul:
        peak = (cpu_peaks or {}).get(m.dtype) if m.device == "cpu" else None
        mm.add_row(m.device, m.dtype, str(m.size), str(m.reps), f"{m.seconds_per_run:.3f}", f"{m.tflops:.3f}",
                   f"{peak:.3f}" if peak else "-", f"{m.tflops / peak:.0%}" if peak else "-")
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
