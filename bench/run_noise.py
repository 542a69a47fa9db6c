#!/usr/bin/env python
"""Offline: how far the median of three fresh runs comes out above the highest of k earlier runs at the
same batch size, from the benches' recorded resident-set runs.

    .venv/bin/python bench/run_noise.py [--draws N] [--seed S] [FILE.json ...]

FILEs (default: bench/results/accuracy*.json, the CUDA ones left out): each case's three `rss_runs`,
taken as shares of their own median; a set of three seen in several files counts once. Two ways to draw
k + 3 runs of one case, both seeded:
- `pooled`: each run's share drawn from all cases' shares (every case as noisy as the mix);
- `per case`: one case drawn, then each run normal around 1 with that case's own standard deviation
  (a noisy case stays noisy in all its runs).
Per k, the excess (median of the three fresh runs / highest of the k earlier ones - 1) at its 95th and
99th percentiles, and at the percentile where k = 1's reaches calibrate.UNREPEATED_NOISE (what the largest
batch keeps clear above one run): the share calibrate.MAX_OF_RUNS_NOISE keeps above the highest of k runs,
at the same risk. A tool for choosing that constant, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.estimate.calibrate import MAX_OF_RUNS_NOISE, UNREPEATED_NOISE  # noqa: E402

KS = (1, 2, 3, 4)


def run_sets(files: list[Path]) -> list[tuple[float, ...]]:
    """Each case's first three resident-set runs as shares of their median, once per distinct set."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for f in files:
        for case in json.loads(f.read_text()).get("cases", []):
            runs = tuple(case.get("rss_runs") or ())[:3]
            if len(runs) < 3 or runs in seen:
                continue
            seen.add(runs)
            m = statistics.median(runs)
            out.append(tuple(r / m for r in runs))
    return out


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
    a = p.parse_args(argv)
    files = a.files or sorted(f for f in (ROOT / "bench" / "results").glob("accuracy*.json") if "cuda" not in f.name)
    sets = run_sets(files)
    if not sets:
        print("no cases with three resident-set runs in", ", ".join(map(str, files)), file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    pool = [s for case in sets for s in case]
    sds = [statistics.stdev(case) for case in sets]

    def per_case(n: int) -> list[float]:
        sd = rng.choice(sds)
        return [1 + rng.gauss(0, sd) for _ in range(n)]

    draws = {"pooled": lambda n: [rng.choice(pool) for _ in range(n)], "per case": per_case}
    print(f"{len(sets)} distinct sets of three runs from {len(files)} file(s); {a.draws} draws per row")
    print(f"calibrate.MAX_OF_RUNS_NOISE (k = 1, 2, 3+): {', '.join(f'{x:.1%}' for x in MAX_OF_RUNS_NOISE)}")
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
