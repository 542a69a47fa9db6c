#!/usr/bin/env python
"""Offline: how a workload's resident-set noise, seen as the range of repeated runs at one batch size,
carries to a larger batch of the same workload: the law `Calibration.repeat_noise` applies to a range.

    .venv/bin/python bench/research/range_law.py [FILE.json ...]

FILEs (default: bench/results/accuracy*.json and bench/results/archive/accuracy*.json, the CUDA ones left out). Within
one file, each workload, precision and optimizer ran three runs at each of two (or more) batch sizes on one machine.
For each smaller set and each larger one of the same case: the range of each pair of the smaller set's runs (as
`repeat_noise` sees two runs at a calibration batch, a share of their median), and the larger set's highest run over
its median (how far one run at the answer strays above the middle of its runs).

Printed: the exponent of the within-workload law (the least-squares slope of log(range at the larger
over range at the smaller) against log(resident-set ratio), where both ranges are non-zero), the median
ratio of the two ranges by bins of the resident-set ratio, and, per exponent tried, how often a pair's
range carried to the larger set's resident set falls short of that set's highest run's excess (a margin
too narrow), alone and with calibration.UNREPEATED_NOISE's floor (as `noise_share` keeps), and the median
kept (share). A tool for choosing the exponent, not a benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.estimate.resident.calibration import NOISE_LAW_FROM, NOISE_REF_BYTES, UNREPEATED_NOISE  # noqa: E402

EXPONENTS = (0.0, 1 / 3, 0.49, 2 / 3, 1.0)
RATIO_BINS = ((1.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, 100.0))


def pairs_of_sets(files: list[Path]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(smaller batch's runs, larger batch's runs) for each case's batch sizes within one file, once each."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for f in files:
        groups: dict[str, dict[int, tuple[int, ...]]] = {}
        for c in json.loads(f.read_text()).get("cases", []):
            runs = tuple(c.get("rss_runs") or ())[:3]
            if len(runs) < 3 or "batch_size" not in c:
                continue
            key = json.dumps([c["workload"], c.get("workload_args"), c["precision"], c["optimizer"]], sort_keys=True)
            groups.setdefault(key, {})[c["batch_size"]] = runs
        for by_batch in groups.values():
            for b1, b2 in itertools.combinations(sorted(by_batch), 2):
                pair = (by_batch[b1], by_batch[b2])
                if statistics.median(pair[1]) > statistics.median(pair[0]) and pair not in seen:
                    seen.add(pair)
                    out.append(pair)
    return out


def scale(seen: float, resident: float, exponent: float) -> float:
    seen = max(seen, NOISE_LAW_FROM)
    return 1.0 if resident <= seen else (seen / resident) ** exponent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("files", nargs="*", type=Path)
    a = p.parse_args(argv)
    files = a.files or sorted(f for f in (ROOT / "bench" / "results").rglob("accuracy*.json") if "cuda" not in f.name)
    pairs = pairs_of_sets(files)
    if not pairs:
        print("no case with three runs at two batch sizes in", ", ".join(map(str, files)), file=sys.stderr)
        return 2
    xs, ys = [], []
    rows = []  # (two runs' range, its median, larger set's median, larger set's highest run's excess)
    for small, large in pairs:
        m2 = statistics.median(large)
        excess = max(large) / m2 - 1
        r1 = (max(small) - min(small)) / statistics.median(small)
        r2 = (max(large) - min(large)) / m2
        if r1 > 0 and r2 > 0:
            xs.append(np.log(m2 / statistics.median(small)))
            ys.append(np.log(r2 / r1))
        for x, y in itertools.combinations(small, 2):
            med = (x + y) / 2
            rows.append((abs(x - y) / med, med, m2, excess))
    slope = float(np.sum(np.array(xs) * np.array(ys)) / np.sum(np.array(xs) ** 2))
    ratios = [float(np.exp(x)) for x in xs]
    print(f"{len(pairs)} pairs of three-run sets (one case, two batch sizes, one file) from {len(files)} file(s); "
          f"resident-set ratio median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    print(f"within-workload law through {len(xs)} pairs with both ranges non-zero: range ~ resident^{slope:.2f}")
    print("| resident-set ratio | pairs | median range ratio (larger / smaller) | larger range wider |")
    print("|---|---|---|---|")
    for lo, hi in RATIO_BINS:
        sel = [y for x, y in zip(xs, ys) if lo <= np.exp(x) < hi]
        if sel:
            print(f"| {lo:.1f}-{hi:.1f} | {len(sel)} | {float(np.exp(np.median(sel))):.2f} | "
                  f"{sum(y > 0 for y in sel) / len(sel):.0%} |")
    print(f"{len(rows)} two-run ranges of the smaller set, each carried to the larger set's median")
    print("| exponent | short of the excess | with the floor | median kept | with the floor |")
    print("|---|---|---|---|---|")
    for e in EXPONENTS:
        kept = [r * scale(med, m2, e) for r, med, m2, _ in rows]
        floored = [max(k, UNREPEATED_NOISE * scale(NOISE_REF_BYTES, m2, 1 / 3)) for k, (_, _, m2, _) in zip(kept, rows)]
        short = sum(k < ex for k, (*_, ex) in zip(kept, rows)) / len(rows)
        short_f = sum(k < ex for k, (*_, ex) in zip(floored, rows)) / len(rows)
        print(f"| {e:.2f} | {short:.1%} | {short_f:.1%} | {statistics.median(kept):.2%} | "
              f"{statistics.median(floored):.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
