#!/usr/bin/env python
"""Offline: where a CPU training step's resident set lives, step by step (glibc's heap or mappings).

    .venv/bin/python bench/research/heap_steps.py [--steps N] [--batches B,B,...] CASE
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. mlp:fp32:sgd-momentum:1024

Per batch size (default: the case's), in a fresh process, docs/design.md's CPU protocol as advisor.measure
runs it (the workload loaded, the kernel's high-water mark reset, then the build and N steps, each on
a new batch), printing after each step the peak resident set over the one at the reset (VmHWM, MiB)
and the resident MiB of the main arena's heap (`[heap]`, grown by brk) and of
anonymous mappings (glibc's mapped chunks, other arenas, thread stacks, the dataset), from
/proc/self/smaps; and glibc's own count (mallinfo2, all arenas): `inuse`, the bytes of chunks in use,
and `free`, the bytes of free chunks inside the arenas' heaps: what fragmentation holds (a freed chunk
stays resident until reused, unless it is at the heap's top past the trim threshold). What a
resident-set model misses shows as which of them grows with the batch and over the steps. A tool for
deciding the resident-set model, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "research"))

from mapped_moments import parse_case  # noqa: E402


def regions_mib() -> tuple[int, int]:
    """(resident MiB of [heap], of anonymous mappings) in this process."""
    heap = anon = 0
    kind = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split()
            kind = "heap" if fields[-1] == "[heap]" else "anon" if len(fields) == 5 else None
        elif line.startswith("Rss:") and kind:
            kb = int(line.split()[1])
            heap, anon = (heap + kb, anon) if kind == "heap" else (heap, anon + kb)
    return heap // 1024, anon // 1024


def protocol(case: str, batch: int, steps: int, before_build=None, after_build=None, after_step=None) -> int:
    """docs/design.md's CPU protocol as advisor.measure runs it, in this process: the workload loaded, the
    high-water mark reset, the build, then `steps` steps on a new batch each; `before_build()`,
    `after_build()` and `after_step(i, peak)` (peak: VmHWM over the reset, bytes) called on the way.
    Returns the peak (bytes)."""
    import torch

    from advisor.config import OptimizerKind, Precision
    from advisor.procmem import current_rss, mark_peak, peak_rss
    from advisor.training import prepare, train_step
    from advisor.workload import load_workload

    spec, prec, opt, _, args = parse_case(case)
    w = load_workload(spec, args)
    torch.manual_seed(0)
    mark_peak()
    base = current_rss()
    if before_build is not None:
        before_build()
    ctx = prepare(w.build_model(), w.loss_fn, precision=Precision(prec), optimizer=OptimizerKind(opt))
    if after_build is not None:
        after_build()
    for i in range(steps):
        train_step(ctx, w.make_batch(batch))
        if after_step is not None:
            after_step(i, peak_rss() - base)
    return peak_rss() - base


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def libc() -> ctypes.CDLL:
    """glibc, with the signatures the replay and mallinfo2 need."""
    c = ctypes.CDLL("libc.so.6")
    c.malloc.restype = ctypes.c_void_p
    c.realloc.restype, c.realloc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    c.mallinfo2.restype = MallInfo2
    return c


def mallinfo_mib() -> tuple[int, int]:
    """(bytes in use, bytes free inside the heaps) over all of glibc's arenas (mallinfo2, glibc 2.33+), MiB."""
    m = libc().mallinfo2()
    return m.uordblks >> 20, m.fordblks >> 20


def one(case: str, batch: int, steps: int) -> None:
    def built() -> None:
        heap, anon = regions_mib()
        print(f"  b={batch:<6} built: heap {heap:5d}  anon {anon:5d}", flush=True)

    def stepped(i: int, peak: int) -> None:
        heap, anon = regions_mib()
        inuse, free = mallinfo_mib()
        print(f"  b={batch:<6} step {i}: VmHWM +{peak >> 20:5d}  heap {heap:5d}  anon {anon:5d}  inuse {inuse:5d}  "
              f"free {free:5d}",
              flush=True)

    protocol(case, batch, steps, after_build=built, after_step=stepped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the case's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the fresh process's batch
    a = ap.parse_args()
    if a.one is not None:
        one(a.case, a.one, a.steps)
        return
    batches = [int(b) for b in a.batches.split(",")] if a.batches else [parse_case(a.case)[3]]
    print(f"{a.case}: MiB")
    for b in batches:
        subprocess.run([sys.executable, __file__, a.case, "--one", str(b), "--steps", str(a.steps)], check=True)


if __name__ == "__main__":
    main()
