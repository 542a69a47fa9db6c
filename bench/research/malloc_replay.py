#!/usr/bin/env python
"""Offline: a training run's whole malloc stream, logged, then replayed through this host's glibc.

    .venv/bin/python bench/research/malloc_replay.py [--steps N] [--runs K] [--min-sizes 0,4096] CASE
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. mlp:fp32:sgd-momentum:1024

K times (default 2): compiles bench/research/malloc_log.c with gcc, runs the case in a fresh process under it
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
does not, the small allocations are what keeps freed chunks from being reused.

    .venv/bin/python bench/research/malloc_replay.py --predict [--batches B,B,B] [--runs K] [--replays R] CASE

A candidate resident-set model, tried on real runs: one logged run at each of --batches (default: the
calibration's for the case's batch), each log replayed R times; the largest one's log with every
tensor's size (torch's CPU allocator calls posix_memalign, the rest of the stream does not) put on the
line through its sizes at those batches, at the case's batch, and replayed R times; predicted = the
median of those replays + the median over the runs of run - its own log's replays (what the process
holds outside malloc). Then K real runs at the batch (advisor.measure) to compare with.

Tools for deciding the resident-set model, not benchmarks of a goal.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "research"))

from heap_steps import libc, protocol  # noqa: E402
from mapped_moments import parse_case  # noqa: E402

MiB = 2**20


def run_logged(case: str, steps: int, log: str) -> None:
    """The child under the shim: docs/design.md's CPU protocol, logging from the reset on; prints its peak (MiB)."""

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
                out.append(("memalign" if kind == "memalign" else "malloc", n, int(size),
                            int(old[0], 16) if old else 0))
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


def with_batch(case: str, batch: int) -> str:
    """CASE with its batch size replaced."""
    f = case.split(":")
    at = 4 if f[0].endswith(".py") else 3  # a workload file's spec keeps its own colon (parse_case)
    return ":".join(f[:at] + [str(batch)] + f[at + 1:])


def _paired(earlier: list[int], last: list[int]) -> dict[int, int]:
    """Index in `last` -> index in `earlier` of the same tensor allocation in two runs' posix_memalign
    sizes: by position where the runs made as many; else difflib's alignment anchored on the sizes both
    made, where runs of sizes only one made (the batch's tensors) pair in order and what one run has
    beyond the other (a kernel's extra buffer at one batch) pairs with nothing."""
    import difflib

    if len(earlier) == len(last):  # the same tensor program: the k-th is the k-th
        return {k: k for k in range(len(last))}
    # a size only one run made is the batch's (it scales): one token for all of those, so the alignment
    # anchors on the sizes both runs made and pairs the scaled ones between anchors in order
    se, sl = set(earlier), set(last)
    a, b = [x if x in sl else -1 for x in earlier], [x if x in se else -1 for x in last]
    pairs = {}
    for tag, i0, i1, j0, j1 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("equal", "replace"):
            pairs.update({j0 + k: i0 + k for k in range(min(i1 - i0, j1 - j0))})
    return pairs


def extrapolated_log(logs: dict[int, str], batch: int, out: str) -> tuple[int, dict[int, int]]:
    """Write to `out` the log of the largest batch in `logs` (batch size -> log path) with each tensor
    allocation's size (posix_memalign: torch's CPU allocator) on the least-squares line through its
    sizes at the logs' batches (`_paired`), at `batch`; one paired with no other run's keeps its size.
    Returns how many sizes moved, and the tensor allocations per log (batch size -> count)."""
    import numpy as np

    sizes = {b: [int(line.split()[1]) for line in open(p) if line.startswith("memalign ")] for b, p in logs.items()}
    bs = sorted(logs)
    last = sizes[bs[-1]]
    pairs = {b: _paired(sizes[b], last) for b in bs[:-1]}
    new = []
    for k, size in enumerate(last):
        pts = [(b, sizes[b][pairs[b][k]]) for b in bs[:-1] if k in pairs[b]] + [(bs[-1], size)]
        if len(pts) < 2 or len({s for _, s in pts}) == 1:
            new.append(size)
            continue
        slope, intercept = np.polyfit(*np.array(pts, float).T, 1)
        new.append(max(1, int(round(intercept + slope * batch))))
    k = 0
    with open(logs[bs[-1]]) as src, open(out, "w") as dst:
        for line in src:
            if line.startswith("memalign "):
                f = line.split()
                f[1] = str(new[k])
                k += 1
                line = " ".join(f) + "\n"
            dst.write(line)
    return sum(a != b for a, b in zip(new, last)), {b: len(v) for b, v in sizes.items()}


def _run(me: list[str], case: str, log: str, shim: str) -> int:
    """One logged run of `case` in a fresh process under the shim: its VmHWM over the reset (MiB)."""
    out = subprocess.run(me[:2] + [case] + me[3:] + ["--child", "run", log], env={**os.environ, "LD_PRELOAD": shim},
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _replay(me: list[str], log: str, min_size: int = 0) -> tuple[int, ...]:
    """One replay of `log` in a fresh process: VmHWM over its reset, in use, free in heaps, mapped (MiB)."""
    r = subprocess.run(me + ["--child", "replay", str(min_size), "--log", log], capture_output=True, text=True,
                       check=True)
    return tuple(int(x) for x in r.stdout.split()[-4:])


def observe(a, me: list[str], shim: str, d: str) -> None:
    print(f"{a.case}, {a.steps} steps: MiB (replays: VmHWM over the reset; at the end in use / free in heaps / mapped)")
    for k in range(a.runs):
        log = os.path.join(d, f"run{k}.log")
        row = [f"run {k}: VmHWM +{_run(me, a.case, log, shim)}"]
        for m in a.min_sizes.split(","):
            hwm, inuse, free, mapped = _replay(me, log, int(m))
            row.append(f"replay >= {m} B: +{hwm} ({inuse} / {free} / {mapped})")
        print("  " + ";  ".join(row), flush=True)
        os.remove(log)


def predict(a, me: list[str], shim: str, d: str) -> None:
    """The resident set at the case's batch from logged runs at smaller ones: the largest one's log with
    tensors' sizes extrapolated (extrapolated_log), replayed; plus what the runs held beyond their own
    logs' replays (memory outside malloc: the median over the runs). Against real runs at the batch."""
    import statistics

    from advisor.estimate.resident.calibrate import calibration_batches
    from advisor.measure import MeasureRequest, measure

    spec, prec, opt, batch, args = parse_case(a.case)
    batches = [int(b) for b in a.batches.split(",")] if a.batches else list(calibration_batches(batch))
    logs, outside = {}, []
    for b in batches:
        logs[b] = os.path.join(d, f"b{b}.log")
        peak = _run(me, with_batch(a.case, b), logs[b], shim)
        replays = [_replay(me, logs[b])[0] for _ in range(a.replays)]
        outside.append(peak - statistics.median(replays))
        print(f"  b={b}: run +{peak}, its log replayed +{', +'.join(map(str, replays))}: outside malloc "
              f"{outside[-1]:.0f}", flush=True)
    target = os.path.join(d, f"b{batch}-extrapolated.log")
    moved, counts = extrapolated_log(logs, batch, target)
    replays = [_replay(me, target)[0] for _ in range(a.replays)]
    predicted = statistics.median(replays) + statistics.median(outside)
    per_run = ", ".join(map(str, counts.values()))
    paired = "by position" if len(set(counts.values())) == 1 else f"aligned ({per_run} per run)"
    print(f"  b={batch}: {moved} tensor sizes extrapolated, paired {paired}; replayed "
          f"+{', +'.join(map(str, replays))}; predicted {predicted:.0f}",
          flush=True)
    real = [measure(MeasureRequest(workload=spec, workload_args=args, batch_size=batch, precision=prec,
                                   optimizer=opt)).rss_delta_bytes // MiB for _ in range(a.runs)]
    if real:
        med = statistics.median(real)
        print(f"  b={batch}: real runs +{', +'.join(map(str, real))}, median {med:.0f}: predicted "
              f"{predicted / med - 1:+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2, help="logged runs (observe), or real runs at the batch (--predict)")
    ap.add_argument("--min-sizes", default="0,4096",
                    help="comma-separated: replay allocations of at least this many bytes")
    ap.add_argument("--predict", action="store_true",
                    help="predict the batch's resident set from logged runs at --batches")
    ap.add_argument("--batches", default=None,
                    help="--predict: the logged runs' batch sizes (default: the calibration's)")
    ap.add_argument("--replays", type=int, default=3, help="--predict: replays per log")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # (run|replay, log or min size)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        run_logged(a.case, a.steps, a.child[1]) if a.child[0] == "run" else replay(a.log, int(a.child[1]))
        return
    with tempfile.TemporaryDirectory() as d:
        shim = os.path.join(d, "malloc_log.so")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim,
                        str(ROOT / "bench" / "research" / "malloc_log.c"), "-ldl"], check=True)
        me = [sys.executable, __file__, a.case, "--steps", str(a.steps)]
        (predict if a.predict else observe)(a, me, shim, d)


if __name__ == "__main__":
    main()
