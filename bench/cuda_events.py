#!/usr/bin/env python
"""Offline reading of the allocator events `bench/cuda_peak_blocks.py --events DIR` kept from a GPU: for each
case, the real step's events and our traced sequence replayed through `cuda_alloc.simulate_cuda`, the real
peaks it ran to (max_memory_allocated / reserved, from DIR/peaks.jsonl), and the segments each replay creates
that the other does not. No GPU needed.

    python bench/cuda_events.py bench/results/cuda-events-h200-s41

Where the replay of the real events gives the real reserved peak, the allocator model is right and a miss
lies in the traced sequence (which allocations, in which order); the segment sizes say where to look. The
traced sequence is the trace's own: library workspaces placed at evaluation (cuBLAS's) are not in it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from advisor.estimate import cuda_alloc  # noqa: E402
from bench.cuda_peak_blocks import _as_sequence  # noqa: E402

MIB = 2**20


def segments(sizes: np.ndarray, ids: np.ndarray) -> tuple[tuple[int, int], list[int]]:
    """simulate_cuda's (allocated, reserved) peaks and the size of each segment it creates, in order."""
    made: list[int] = []
    segment = cuda_alloc._segment

    def counted(size: int) -> int:
        made.append(segment(size))
        return made[-1]

    cuda_alloc._segment = counted
    try:
        peaks = cuda_alloc.simulate_cuda(sizes, ids)
    finally:
        cuda_alloc._segment = segment
    return peaks, made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a --events directory (its *.npz and peaks.jsonl)")
    args = ap.parse_args(argv)
    measured = {}
    if (args.dir / "peaks.jsonl").exists():
        for line in (args.dir / "peaks.jsonl").read_text().splitlines():
            rec = json.loads(line)
            measured[Path(rec.get("events", "")).name] = (rec.get("max_memory_allocated"), rec.get("max_memory_reserved"))
    print(f"{'case':40s} {'measured':>17s} {'real events':>17s} {'our trace':>17s}  (allocated / reserved, MiB)")
    for path in sorted(args.dir.glob("*.npz")):
        d = np.load(path)
        (ra, rr), rseg = segments(*_as_sequence(d["real_action"], d["real_addr"], d["real_size"]))
        (oa, orr), oseg = segments(d["ours_sizes"], d["ours_ids"])
        ma, mr = measured.get(path.name, (None, None))
        shown = "—" if ma is None else f"{ma / MIB:.0f} / {mr / MIB:.0f}"
        print(f"{path.stem:40s} {shown:>17s} {f'{ra / MIB:.0f} / {rr / MIB:.0f}':>17s} {f'{oa / MIB:.0f} / {orr / MIB:.0f}':>17s}")
        real, ours = Counter(s // MIB for s in rseg), Counter(s // MIB for s in oseg)
        print(f"    segments (MiB x count) only in the real run: {sorted((real - ours).items())}; "
              f"only in ours: {sorted((ours - real).items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
