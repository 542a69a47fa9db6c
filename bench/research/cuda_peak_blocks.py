#!/usr/bin/env python
"""What is live on the GPU at a real training step's peaks: a diagnostic for the CUDA accuracy
bench's misses, not a benchmark. Needs a CUDA GPU.

    python bench/research/cuda_peak_blocks.py --case mlp:fp32:adamw:4096 --case bert-base:bf16:adamw:32:seq_len=512 \
        [--out peaks.jsonl]

Each case runs docs/design.md's CUDA protocol (advisor.measure, mode 'cuda') in a fresh process with the
caching allocator's history recorded (torch.cuda.memory._record_memory_history; Python stacks, C++
frames too with --stacks all), then replays the history: at the allocated peak, the live blocks
grouped by the first frame of ours or of torch.nn / torch.optim / torch.autograd that allocated them
(bytes, count, largest; with --stacks all, a block allocated inside an op by the C++ frame that
asked), and the 40 largest blocks; at the reserved peak, the segments (count, sizes) and what was
allocated in them then. One JSON line per case.

With --events DIR, each case also leaves DIR/<case>.npz for offline study: the real step's allocator
events (action, address, size, stream, the label of the frame that asked) and our estimate's traced
allocation sequence for the same case on this GPU (sizes, ids, category of each event), and the line
adds what cuda_alloc.simulate_cuda makes of each sequence: whether a reserved gap is the allocator
model's or the trace's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OURS = ("advisor/", "torch/nn/", "torch/optim/", "torch/autograd/", "torch/amp/")


# C++ frames (--stacks all) worth naming: the op or library call that asked the allocator
NATIVE = ("at::native::", "at::cuda::", "cublas", "cudnn", "torch::autograd::")


def _label(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            where = f["filename"].split("site-packages/")[-1].removeprefix(f"{ROOT}/")
            return f"{where}:{f['line']} {f['name']}"
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


ACTIONS = ("other", "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap")


def _as_sequence(actions: np.ndarray, addrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A real trace's allocations and completed frees as simulate_cuda's (+size / -size, id) sequence."""
    out_sizes, out_ids, live, next_id = [], [], {}, 0
    for act, addr, size in zip(actions.tolist(), addrs.tolist(), sizes.tolist()):
        if act == 1:
            live[addr] = next_id
            out_sizes.append(size), out_ids.append(next_id)
            next_id += 1
        elif act == 3 and addr in live:
            out_sizes.append(-size), out_ids.append(live.pop(addr))
    return np.asarray(out_sizes, dtype=np.int64), np.asarray(out_ids, dtype=np.int64)


def save_events(path: Path, trace: list[dict[str, Any]], workload: str, precision: str, optimizer: str, batch: int,
                args: dict[str, int]) -> dict[str, Any]:
    """Write the real events and our traced sequence of one case to `path` (npz); what simulate_cuda makes of each."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory, evaluator
    from advisor.estimate.cuda_alloc import simulate_cuda
    from advisor.hardware import get_hardware

    labels: dict[str, int] = {}
    code = {a: i for i, a in enumerate(ACTIONS)}
    actions = np.array([code.get(ev["action"], 0) for ev in trace], dtype=np.int8)
    addrs = np.array([ev.get("addr", 0) for ev in trace], dtype=np.int64)
    sizes = np.array([ev.get("size", 0) for ev in trace], dtype=np.int64)
    streams = np.array([ev.get("stream", 0) for ev in trace], dtype=np.int64)
    where = np.array([labels.setdefault(_label(ev.get("frames", [])), len(labels)) if ev["action"] == "alloc" else -1
                      for ev in trace], dtype=np.int32)
    seen: list = []
    at = evaluator.Evaluator.at

    def keep(self, b, strategy=None, runs=False):  # the trace the estimate evaluates at the case's batch
        out = at(self, b, strategy, runs)
        if b == batch and not seen:
            seen.append(out[0])
        return out

    evaluator.Evaluator.at = keep
    try:
        est = estimate_memory(workload, get_hardware("local"),
                              EstimateRequest(batch_size=batch, precision=precision, optimizer=optimizer),
                              EstimateOptions(measured=False), workload_args=args)
    finally:
        evaluator.Evaluator.at = at
    tr = seen[0]
    steps = np.diff(tr.curve, axis=0, prepend=np.zeros((1, tr.curve.shape[1]), dtype=tr.curve.dtype))
    np.savez_compressed(path, real_action=actions, real_addr=addrs, real_size=sizes, real_stream=streams,
                        real_where=where, real_labels=np.array(json.dumps(list(labels))), ours_sizes=tr.sizes,
                        ours_ids=tr.ids, ours_category=np.abs(steps).argmax(axis=1).astype(np.int8))
    real_alloc, real_res = simulate_cuda(*_as_sequence(actions, addrs, sizes))
    ours_alloc, ours_res = simulate_cuda(tr.sizes, tr.ids)
    return {"events": str(path), "simulated_from_real_events": {"allocated": real_alloc, "reserved": real_res},
            "simulated_from_our_trace": {"allocated": ours_alloc, "reserved": ours_res},
            "estimate": {"total": est.total_bytes, "allocated": est.allocated_bytes},
            "streams": sorted(set(streams.tolist()))}


def child(spec: str, stacks: str, events: Path | None = None) -> dict[str, Any]:
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
    if events is not None:
        events.mkdir(parents=True, exist_ok=True)
        name = spec.replace(":", "_").replace("=", "-").replace(",", "_")
        out.update(save_events(events / f"{name}.npz", snap["device_traces"][0], workload, precision, optimizer,
                               int(batch), {k: int(v) for k, v in args.items()}))
    return {"case": spec, "max_memory_allocated": res.alloc_peak_bytes, "max_memory_reserved": res.cuda_reserved_bytes,
            **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[],
                    help="workload:precision:optimizer:batch[:key=int,...] (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per case here")
    ap.add_argument("--stacks", choices=("python", "all"), default="python", help="'all' adds C++ frames (slower): "
                    "names the op or library inside which a block without a Python frame was allocated")
    ap.add_argument("--events", type=Path, default=None, help="also write each case's real allocator events and our "
                    "traced sequence here (npz), with simulate_cuda's peaks of both in the line")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.stacks, args.events)))
        return 0
    for spec in args.case:
        cmd = [sys.executable, __file__, "--child", spec, "--stacks", args.stacks]
        if args.events is not None:
            cmd += ["--events", str(args.events.resolve())]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else \
            json.dumps({"case": spec, "error": proc.stderr.strip()[-2000:]})
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
