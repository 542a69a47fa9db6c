#!/usr/bin/env python
"""Offline: a training run's whole malloc stream, logged, then replayed through this host's glibc.

    .venv/bin/python bench/malloc_replay.py [--steps N] [--runs K] [--min-sizes 0,4096] CASE
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. mlp:fp32:sgd-momentum:1024

K times (default 2): compiles bench/malloc_log.c with gcc, runs the case in a fresh process under it
(LD_PRELOAD) as advisor.measure does (the workload loaded, the high-water mark reset, then the build
and N steps, each on a new batch), logging every malloc, calloc, realloc, posix_memalign and free from
the reset on, and prints the run's peak resident set over the reset (VmHWM, MiB). Then, per
--min-sizes value, replays that log in a fresh process (torch imported, nothing trained): every
allocation of at least that many bytes made and written, every free of one done, in the logged
order, through this process's glibc; prints the replay's VmHWM over its own reset and glibc's count
at its end (mallinfo2: bytes in use, bytes free inside the heaps, bytes mapped).

The replay of every size carries the small allocations (Python's and C++'s objects, tensors'
metadata) that sit between tensors' chunks in glibc's main heap; the replay from 4 KiB up carries
tensors' data only, as a trace of tensors does. Where the first reproduces the run and the second
does not, the small allocations are what keeps freed chunks from being reused. A tool for deciding
the resident-set model, not a benchmark of a goal (bench/BENCHMARKS.calibration.md, "Session 25").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from heap_steps import protocol  # noqa: E402
from mapped_moments import parse_case  # noqa: E402

MiB = 2**20


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def libc() -> ctypes.CDLL:
    """glibc, with the signatures the replay and mallinfo2 need."""
    c = ctypes.CDLL("libc.so.6")
    c.malloc.restype = ctypes.c_void_p
    c.realloc.restype, c.realloc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    c.mallinfo2.restype = MallInfo2
    return c


def run_logged(case: str, steps: int, log: str) -> None:
    """The child under the shim: DESIGN.md's CPU protocol, logging from the reset on; prints its peak (MiB)."""

    def start() -> None:
        os.environ["MALLOC_LOG"] = log

    peak = protocol(case, parse_case(case)[3], steps, before_build=start)
    del os.environ["MALLOC_LOG"]
    print(peak // MiB)


def _events(log: str, min_size: int) -> list[tuple]:
    """The log as (op, allocation number, bytes, alignment) in order, allocations under `min_size`
    bytes and their frees left out; a realloc of a kept allocation follows it to its new address."""
    out, at, n = [], {}, 0
    with open(log) as f:
        for line in f:
            kind, size, ptr, *old = line.split()
            if kind == "free":
                if ptr in at:
                    out.append(("free", at.pop(ptr), 0, 0))
            elif kind == "realloc" and old and old[0] in at:
                i = at.pop(old[0])
                out.append(("realloc", i, int(size), 0))
                at[ptr] = i
            elif int(size) >= min_size:
                at[ptr] = n
                out.append(("memalign" if kind == "memalign" else "malloc", n, int(size), int(old[0], 16) if old else 0))
                n += 1
    return out


def replay(log: str, min_size: int) -> None:
    """The child that replays: prints VmHWM over its reset, then glibc's in use / free / mapped (MiB)."""
    import torch  # noqa: F401 - the heap as a run's process has it after its imports

    from advisor.procmem import current_rss, mark_peak, peak_rss

    events = _events(log, min_size)
    lib = libc()
    live: dict[int, int] = {}
    mark_peak()
    base = current_rss()
    for op, i, size, align in events:
        if op == "free":
            if i in live:
                lib.free(live.pop(i))
        elif op == "realloc":
            if i in live:
                live[i] = lib.realloc(live[i], max(size, 1))
                ctypes.memset(live[i], 1, size)
        else:
            if op == "memalign":
                p = ctypes.c_void_p()
                if lib.posix_memalign(ctypes.byref(p), align, max(size, 1)):
                    raise MemoryError(size)
                ptr = p.value
            else:
                ptr = lib.malloc(max(size, 1))
            ctypes.memset(ptr, 1, size)  # a kernel writes what it allocates
            live[i] = ptr
    m = lib.mallinfo2()
    print((peak_rss() - base) // MiB, m.uordblks // MiB, m.fordblks // MiB, m.hblkhd // MiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--min-sizes", default="0,4096", help="comma-separated: replay allocations of at least this many bytes")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # (run|replay, log or min size)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        run_logged(a.case, a.steps, a.child[1]) if a.child[0] == "run" else replay(a.log, int(a.child[1]))
        return
    with tempfile.TemporaryDirectory() as d:
        shim = os.path.join(d, "malloc_log.so")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim, str(ROOT / "bench" / "malloc_log.c"), "-ldl"], check=True)
        me = [sys.executable, __file__, a.case, "--steps", str(a.steps)]
        print(f"{a.case}, {a.steps} steps: MiB (replays: VmHWM over the reset; at the end in use / free in heaps / mapped)")
        for k in range(a.runs):
            log = os.path.join(d, f"run{k}.log")
            out = subprocess.run(me + ["--child", "run", log], env={**os.environ, "LD_PRELOAD": shim},
                                 capture_output=True, text=True, check=True)
            row = [f"run {k}: VmHWM +{out.stdout.split()[-1]}"]
            for m in a.min_sizes.split(","):
                r = subprocess.run(me + ["--child", "replay", m, "--log", log], capture_output=True, text=True, check=True)
                hwm, inuse, free, mapped = r.stdout.split()[-4:]
                row.append(f"replay >= {m} B: +{hwm} ({inuse} / {free} / {mapped})")
            print("  " + ";  ".join(row), flush=True)
            os.remove(log)


if __name__ == "__main__":
    main()
