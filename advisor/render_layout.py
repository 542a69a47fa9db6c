"""The table of a parallel layout's estimate: one column per pipeline rank (its stages), rows by memory part."""

from __future__ import annotations

from typing import TYPE_CHECKING

from advisor.render import human_bytes

if TYPE_CHECKING:
    from advisor.estimate.parallel import LayoutEstimate

COMM_LABEL = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
              "send": "send", "recv": "recv", "broadcast": "broadcast", "all_to_all": "all-to-all"}


def layout_table(est: "LayoutEstimate") -> None:
    from rich.console import Console
    from rich.table import Table

    r, lay = est.request, est.layout
    title = (f"{est.workload} on {est.hardware} x{lay.world} ({lay.label()}): batch {r.batch_size} per replica, "
             f"{r.precision.value}, {r.optimizer.value}"
             + (f", {r.checkpointing.value} checkpointing" if r.checkpointing else "")
             + (f", {est.grad_accum} batches accumulated per step" if est.grad_accum > 1 else ""))
    table = Table(title=title, show_header=True)
    table.add_column("per device")
    for rank in est.ranks:
        stages = ",".join(map(str, rank.stages))
        table.add_column(f"stage {stages}" + (f" ({rank.layers} layers)" if rank.layers else ""), justify="right")
    for part in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead"):
        table.add_row(part.replace("_", " "), *(human_bytes(getattr(x.breakdown, part)) for x in est.ranks))
    table.add_section()
    table.add_row(f"total ({est.predicts})", *(human_bytes(x.total_bytes) for x in est.ranks))
    table.add_row("live tensors peak", *(human_bytes(x.allocated_bytes) for x in est.ranks))
    if any(x.nccl_bytes for x in est.ranks):  # outside the allocator, beside the CUDA context
        table.add_row("NCCL buffers", *(human_bytes(x.nccl_bytes) for x in est.ranks))
    if any(x.host_bytes for x in est.ranks):  # ZeRO-Offload: what each rank keeps in host memory
        table.add_row("host memory (offload)", *(human_bytes(x.host_bytes) for x in est.ranks))
    table.add_row("verdict", *("[green]fits[/green]" if x.fits else "[red]does not fit[/red]" for x in est.ranks))
    table.add_section()
    kinds = sorted({k for x in est.ranks for k in x.comm_bytes})
    for kind in kinds:
        table.add_row(f"{COMM_LABEL.get(kind, kind)} per step", *(human_bytes(x.comm_bytes.get(kind, 0))
                                                                  for x in est.ranks))
    table.add_row("ranks", *(_ranks(x.ranks) for x in est.ranks))
    console = Console()
    console.print(table)
    usable = f"{human_bytes(est.device_memory_bytes)} per device ({human_bytes(est.usable_bytes)} usable)"
    if est.runtime_bytes:
        usable += f"; CUDA context {human_bytes(est.runtime_bytes)} outside the allocator"
    console.print(usable)
    console.print(f"{est.num_params:,} parameters; method: {est.method}; {est.seconds:.1f} s")
    for note in est.notes:
        console.print(f"note: {note}")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
