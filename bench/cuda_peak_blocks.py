#!/usr/bin/env python
"""What is live on the GPU at a real training step's peaks: a diagnostic for the CUDA accuracy
bench's misses, not a benchmark. Needs a CUDA GPU.

    python bench/cuda_peak_blocks.py --case mlp:fp32:adamw:4096 --case bert-base:bf16:adamw:32:seq_len=512 [--out peaks.jsonl]

Each case runs DESIGN.md's CUDA protocol (advisor.measure, mode 'cuda') in a fresh process with the
caching allocator's history recorded (torch.cuda.memory._record_memory_history; Python stacks, C++
frames too with --stacks all), then replays the history: at the allocated peak, the live blocks
grouped by the first frame of ours or of torch.nn / torch.optim / torch.autograd that allocated them
(bytes, count, largest; with --stacks all, a block allocated inside an op by the C++ frame that
asked), and the 40 largest blocks; at the reserved peak, the segments (count, sizes) and what was
allocated in them then. One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OURS = ("advisor/", "torch/nn/", "torch/optim/", "torch/autograd/", "torch/amp/")


# C++ frames (--stacks all) worth naming: the op or library call that asked the allocator
NATIVE = ("at::native::", "at::cuda::", "cublas", "cudnn", "torch::autograd::")


def _label(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    for f in frames:
        if any(part in f["name"] for part in NATIVE):
            return f["name"][:160]
    return "(no Python frame: C++ inside an op)"


def replay(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """The allocated and reserved peaks of a device trace, and what was live at each."""
    live: dict[int, tuple[int, str]] = {}
    segments: dict[int, int] = {}
    alloc = reserved = peak_alloc = peak_reserved = 0
    at_alloc: dict[int, tuple[int, str]] = {}
    at_reserved: tuple[dict[int, int], int] = ({}, 0)
    for ev in trace:
        act, addr, size = ev["action"], ev["addr"], ev["size"]
        if act == "alloc":
            live[addr] = (size, _label(ev.get("frames", [])))
            alloc += size
            if alloc > peak_alloc:
                peak_alloc, at_alloc = alloc, dict(live)
        elif act == "free_completed" and addr in live:
            alloc -= live.pop(addr)[0]
        elif act in ("segment_alloc", "segment_map"):
            segments[addr] = segments.get(addr, 0) + size
            reserved += size
            if reserved > peak_reserved:
                peak_reserved, at_reserved = reserved, (dict(segments), alloc)
        elif act in ("segment_free", "segment_unmap"):
            reserved -= size
            segments.pop(addr, None)
    groups: dict[str, list[int]] = defaultdict(list)
    for size, label in at_alloc.values():
        groups[label].append(size)
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:25]
    blocks = sorted(at_alloc.values(), key=lambda b: -b[0])[:40]
    segs, alloc_then = at_reserved
    return {
        "peak_allocated": peak_alloc,
        "at_allocated_peak": [{"where": k, "bytes": sum(v), "count": len(v), "largest": max(v)} for k, v in top],
        "largest_blocks_at_allocated_peak": [{"bytes": n, "where": where} for n, where in blocks],
        "peak_reserved": peak_reserved,
        "segments_at_reserved_peak": len(segs),
        "segment_sizes_mib": sorted((round(s / 2**20, 1) for s in segs.values()), reverse=True)[:30],
        "allocated_at_reserved_peak": alloc_then,
    }


def child(spec: str, stacks: str) -> dict[str, Any]:
    import torch

    from advisor.measure import MeasureRequest, _run

    workload, precision, optimizer, batch, *rest = spec.split(":")
    args = dict(kv.split("=") for kv in rest[0].split(",")) if rest else {}
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks=stacks)
    res = _run(MeasureRequest(workload=workload, batch_size=int(batch), precision=precision, optimizer=optimizer,
                              workload_args={k: int(v) for k, v in args.items()}, mode="cuda"))
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out = replay(snap["device_traces"][0])
    return {"case": spec, "max_memory_allocated": res.alloc_peak_bytes, "max_memory_reserved": res.cuda_reserved_bytes,
            **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="workload:precision:optimizer:batch[:key=int,...] (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per case here")
    ap.add_argument("--stacks", choices=("python", "all"), default="python", help="'all' adds C++ frames (slower): "
                    "names the op or library inside which a block without a Python frame was allocated")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.stacks)))
        return 0
    for spec in args.case:
        proc = subprocess.run([sys.executable, __file__, "--child", spec, "--stacks", args.stacks], capture_output=True, text=True, cwd=ROOT)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else \
            json.dumps({"case": spec, "error": proc.stderr.strip()[-2000:]})
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
