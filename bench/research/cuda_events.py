#!/usr/bin/env python
"""Offline reading of the allocator events `bench/research/cuda_peak_blocks.py --events DIR` kept from a GPU: for each
case, the real step's events and our traced sequence replayed through `cuda_alloc.simulate_cuda`, the real
peaks it ran to (max_memory_allocated / reserved, from DIR/peaks.jsonl), and the segments each replay creates
that the other does not. No GPU needed.

    python bench/research/cuda_events.py bench/results/cuda-events-h200-s41

Where the replay of the real events gives the real reserved peak, the allocator model is right and a miss
lies in the traced sequence (which allocations, in which order); the segment sizes say where to look. The
traced sequence is the trace's own: library workspaces placed at evaluation (cuBLAS's) are not in it.

--paired: also replay our sequence with each probed op's single scratch (an allocation freed at once) that
stands for two of the real run's in turn (cuDNN's convolution backward: one workspace for the input's
gradient, one for the weight's) replaced by the real two: the real first step's op-internal allocations of
1 MiB or more, walked beside each of our steps; where ours is within 4 MiB of the larger of the real's next
two, it stands for both. A check of what recording each probe's allocations would give, not a model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from advisor.estimate import cuda_alloc  # noqa: E402
from bench.research.cuda_peak_blocks import _as_sequence  # noqa: E402

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


def _scratches(sizes: list[int], ids: list[int]) -> list[int]:
    """Indices of allocations of 1 MiB or more freed by the next event: an op's internal workspaces."""
    return [k for k in range(len(sizes) - 1) if sizes[k] >= MIB and sizes[k + 1] == -sizes[k] and ids[k] == ids[k + 1]]


def paired(real: tuple[np.ndarray, np.ndarray], ours: tuple[np.ndarray, np.ndarray], real_steps: int = 3,
           our_steps: int = 2) -> tuple[np.ndarray, np.ndarray, int]:
    """Our sequence with single scratches that stand for two of the real run's replaced by those two (see --paired)."""
    rs, ri = real[0].tolist(), real[1].tolist()
    s, ids = ours[0].tolist(), ours[1].tolist()
    rt = _scratches(rs, ri)
    step = [rs[k] for k in rt[:len(rt) // real_steps]]
    ot = _scratches(s, ids)
    per = len(ot) // our_steps
    pairs: dict[int, tuple[int, int]] = {}
    for n in range(our_steps):
        j = 0
        for k in ot[n * per:(n + 1) * per]:
            if j + 1 < len(step) and abs(step[j] - s[k]) > MIB and abs(max(step[j], step[j + 1]) - s[k]) <= 4 * MIB:
                pairs[k] = (step[j], step[j + 1])
                j += 2
            else:
                j += 1
    out_s, out_i, fresh = [], [], max(ids) + 1
    for k in range(len(s)):
        if k in pairs:
            a, b = pairs[k]
            out_s += [a, -a, b]
            out_i += [fresh, fresh, fresh + 1]
            fresh += 2
        elif k - 1 in pairs:
            out_s.append(-pairs[k - 1][1])
            out_i.append(fresh - 1)
        else:
            out_s.append(s[k])
            out_i.append(ids[k])
    return np.asarray(out_s, dtype=np.int64), np.asarray(out_i, dtype=np.int64), len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a --events directory (its *.npz and peaks.jsonl)")
    ap.add_argument("--paired", action="store_true", help="also replay ours with single scratches that stand for "
                    "two of the real run's replaced by those two")
    args = ap.parse_args(argv)
    measured = {}
    if (args.dir / "peaks.jsonl").exists():
        for line in (args.dir / "peaks.jsonl").read_text().splitlines():
            rec = json.loads(line)
            measured[Path(rec.get("events", "")).name] = (rec.get("max_memory_allocated"),
                                                          rec.get("max_memory_reserved"))
    print(f"{'case':40s} {'measured':>17s} {'real events':>17s} {'our trace':>17s}  (allocated / reserved, MiB)")
    for path in sorted(args.dir.glob("*.npz")):
        d = np.load(path)
        real_seq = _as_sequence(d["real_action"], d["real_addr"], d["real_size"])
        (ra, rr), rseg = segments(*real_seq)
        (oa, orr), oseg = segments(d["ours_sizes"], d["ours_ids"])
        ma, mr = measured.get(path.name, (None, None))
        shown = "—" if ma is None else f"{ma / MIB:.0f} / {mr / MIB:.0f}"
        print(f"{path.stem:40s} {shown:>17s} {f'{ra / MIB:.0f} / {rr / MIB:.0f}':>17s} "
              f"{f'{oa / MIB:.0f} / {orr / MIB:.0f}':>17s}")
        real, ours = Counter(s // MIB for s in rseg), Counter(s // MIB for s in oseg)
        print(f"    segments (MiB x count) only in the real run: {sorted((real - ours).items())}; "
              f"only in ours: {sorted((ours - real).items())}")
        if args.paired:
            ps, pi, n = paired(real_seq, (d["ours_sizes"], d["ours_ids"]))
            pa, pr = cuda_alloc.simulate_cuda(ps, pi)
            print(f"    ours with {n} scratches paired as the real run's: {pa / MIB:.0f} / {pr / MIB:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
