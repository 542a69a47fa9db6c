#!/usr/bin/env python
"""Offline: how far the median of three fresh runs comes out above the highest of k earlier runs at the
same batch size, from the benches' recorded resident-set runs.

    .venv/bin/python bench/research/run_noise.py [--draws N] [--seed S] [FILE.json ...]

FILEs (default: bench/results/accuracy*.json and bench/results/archive/accuracy*.json, the CUDA ones left out): each
case's three `rss_runs`, taken as shares of their own median; a set of three seen in several files counts once. Two
ways to draw k + 3 runs of one case, both seeded:
- `pooled`: each run's share drawn from all cases' shares (every case as noisy as the mix);
- `per case`: one case drawn, then each run normal around 1 with that case's own standard deviation
  (a noisy case stays noisy in all its runs).
Per k, the excess (median of the three fresh runs / highest of the k earlier ones - 1) at its 95th and
99th percentiles, and at the percentile where k = 1's reaches calibration.UNREPEATED_NOISE (what the largest
batch keeps clear above one run): the share calibration.MAX_OF_RUNS_NOISE keeps above the highest of k runs,
at the same risk. A tool for choosing that constant, not a benchmark of a goal.

`--by-size`: instead, the sets in eight bins of equal count by their median resident set: per bin, the
95th percentile of a run's shortfall below its set's median and of a set's range (both as shares of the
median), and the power law through the bins' 95th percentiles (what calibration.NOISE_EXPONENT takes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.estimate.resident.calibration import MAX_OF_RUNS_NOISE, UNREPEATED_NOISE  # noqa: E402

KS = (1, 2, 3, 4)


def run_sets(files: list[Path], absolute: bool = False) -> list[tuple[float, ...]]:
    """Each case's first three resident-set runs as shares of their median (`absolute`: in bytes), once per
    distinct set."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for f in files:
        for case in json.loads(f.read_text()).get("cases", []):
            runs = tuple(case.get("rss_runs") or ())[:3]
            if len(runs) < 3 or runs in seen:
                continue
            seen.add(runs)
            m = 1 if absolute else statistics.median(runs)
            out.append(tuple(r / m for r in runs))
    return out


def by_size(sets: list[tuple[float, ...]], bins: int = 8) -> None:
    """Print, per bin of sets by median resident set, the 95th percentiles of a run's shortfall below the
    median and of the range (shares), and the power laws through them."""
    import numpy as np

    med = np.array([statistics.median(s) for s in sets])
    below = np.array([[(m - r) / m for r in s] for s, m in zip(sets, med)])
    spread = np.array([(max(s) - min(s)) / m for s, m in zip(sets, med)])
    print(f"{len(sets)} distinct sets of three runs, {bins} bins by their median resident set")
    print("| median GB | sets | p95 below median | p95 range |")
    print("|---|---|---|---|")
    x, y_below, y_range = [], [], []
    for idx in np.array_split(np.argsort(med), bins):
        x.append(float(np.median(med[idx])))
        y_below.append(float(np.percentile(below[idx].ravel(), 95)))
        y_range.append(float(np.percentile(spread[idx], 95)))
        print(f"| {x[-1] / 1e9:.2f} | {len(idx)} | {y_below[-1]:.1%} | {y_range[-1]:.1%} |")
    for name, y in (("below median", y_below), ("range", y_range)):
        slope, icpt = np.polyfit(np.log(x), np.log(y), 1)
        print(f"{name}: share ~ resident^{slope:.2f}, {np.exp(icpt + slope * np.log(1e9)):.1%} at 1 GB")


def excesses(k: int, draw, n: int) -> list[float]:
    """Sorted: median of 3 fresh runs over the highest of k earlier ones, less 1, over n draws."""
    out = []
    for _ in range(n):
        v = draw(k + 3)
        out.append(statistics.median(v[k:]) / max(v[:k]) - 1)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--draws", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--by-size", action="store_true", help="the noise by resident-set size instead (see above)")
    a = p.parse_args(argv)
    files = a.files or sorted(f for f in (ROOT / "bench" / "results").rglob("accuracy*.json") if "cuda" not in f.name)
    sets = run_sets(files, absolute=a.by_size)
    if not sets:
        print("no cases with three resident-set runs in", ", ".join(map(str, files)), file=sys.stderr)
        return 2
    if a.by_size:
        by_size(sets)
        return 0
    rng = random.Random(a.seed)
    pool = [s for case in sets for s in case]
    sds = [statistics.stdev(case) for case in sets]

    def per_case(n: int) -> list[float]:
        sd = rng.choice(sds)
        return [1 + rng.gauss(0, sd) for _ in range(n)]

    draws = {"pooled": lambda n: [rng.choice(pool) for _ in range(n)], "per case": per_case}
    print(f"{len(sets)} distinct sets of three runs from {len(files)} file(s); {a.draws} draws per row")
    print(f"calibration.MAX_OF_RUNS_NOISE (k = 1, 2, 3+): {', '.join(f'{x:.1%}' for x in MAX_OF_RUNS_NOISE)}")
    print("| draw | k | p95 | p99 | at k = 1's percentile for UNREPEATED_NOISE |")
    print("|---|---|---|---|---|")
    for name, draw in draws.items():
        one = excesses(1, draw, a.draws)
        at = next((i for i, x in enumerate(one) if x >= UNREPEATED_NOISE), len(one) - 1) / len(one)
        for k in KS:
            ex = one if k == 1 else excesses(k, draw, a.draws)
            print(f"| {name} | {k} | {ex[int(0.95 * len(ex))]:.2%} | {ex[int(0.99 * len(ex))]:.2%} | "
                  f"{ex[int(at * len(ex))]:.2%} (p{at * 100:.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
