#!/usr/bin/env python
"""What glibc's malloc holds at the peak resident set of a CPU training step (Linux, glibc).

    .venv/bin/python bench/research/glibc_heap.py mlp 1024,2048,3072,4096 [--precision fp32] [--optimizer adamw]
        [--workload-arg key=value ...]

One fresh process per batch size runs docs/design.md's CPU protocol: the high-water mark is reset just
before build_model, then 3 optimizer steps run. A thread samples VmRSS every millisecond. Whenever
VmRSS reaches a new high, the thread reads mallinfo2(): the heap arena (brk), the part of it that is
free (freed but resident, unless trimmed), the bytes in use, and the mapped chunks. So each row shows
how the step's peak splits between live allocations, heap fragmentation and mapped chunks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _child(workload: str, args: dict, batch: int, precision: str, optimizer: str) -> dict:
    import torch

    from advisor.config import OptimizerKind, Precision
    from advisor.procmem import current_rss, mark_peak, peak_rss
    from advisor.training import prepare, train_step
    from advisor.workload import load_workload

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    wl = load_workload(workload, args)
    torch.manual_seed(0)
    best: dict = {"rss": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = current_rss()
            if rss > best["rss"]:
                m = libc.mallinfo2()
                best.update(rss=rss, arena=m.arena, free=m.fordblks, used=m.uordblks, mapped=m.hblkhd)
            time.sleep(0.001)

    mark_peak()
    base = current_rss()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    ctx = prepare(wl.build_model(), wl.loss_fn, precision=Precision(precision), optimizer=OptimizerKind(optimizer),
                  device_type="cpu", checkpointing=False, fused_backward=False)
    for _ in range(3):
        train_step(ctx, wl.make_batch(batch))
    done.set()
    thread.join()
    return {"batch": batch, "peak_rss_delta": peak_rss() - base, "sampled_rss_delta": best["rss"] - base,
            **{k: best.get(k) for k in ("arena", "free", "used", "mapped")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("batches", help="comma-separated batch sizes")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    args = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.workload_arg)}
    if a.child:
        print(json.dumps(_child(a.workload, args, int(a.child), a.precision, a.optimizer)))
        return 0
    print("| batch | peak RSS over baseline MiB | heap arena MiB | of it free | in use | mapped MiB |")
    print("|---|---|---|---|---|---|")
    for b in (int(x) for x in a.batches.split(",")):
        cmd = [sys.executable, __file__, a.workload, a.batches, "--precision", a.precision, "--optimizer", a.optimizer,
               "--child", str(b)] + [f"--workload-arg={kv}" for kv in a.workload_arg]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"| {b} | {r['peak_rss_delta'] // MB} | {r['arena'] // MB} | {r['free'] // MB} | {r['used'] // MB} "
              f"| {r['mapped'] // MB} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
