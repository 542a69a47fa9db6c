#!/usr/bin/env python
"""Offline, from recorded results: how far the estimate should draw the resident-set fit toward the heap's replay
at the batch (calibration.Calibration.at_batch counts the replay as one run: half way where no run is at the batch).

    .venv/bin/python bench/research/blend_weight.py bench/results/accuracy-bf16-s53.json [more results JSON ...]

Each case whose notes say "the fit's F MiB drawn 1/2 of the way to ... (R MiB, the draws' median ...)" is
estimated again as F + w (R - F) for several weights w, the rest of its total unchanged, and compared with its
measured resident set (the median of its runs). Prints the median and largest absolute error per weight. A tool
for checking the rule against what the benches measured, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

MiB = 2**20
NOTE = re.compile(r"resident set at batch \d+: (\d+) MiB, the fit's (\d+) MiB drawn 1/2 of the way to the mean of the "
                  r"calibration runs' own allocations.*?\((\d+) MiB, the draws' median")
WEIGHTS = (0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0)


def blended(paths: list[Path]) -> list[tuple[int, int, int, int, int]]:
    """(measured, our total, the blend's value, the fit's, the replay's) per case, bytes and MiB as recorded."""
    rows = []
    for path in paths:
        for case in json.loads(path.read_text())["cases"]:
            if not case.get("rss_bytes") or not case.get("est_total_bytes"):
                continue
            for note in case.get("notes", []):
                m = NOTE.search(note)
                if m:
                    at, fit, replay = map(int, m.groups())
                    rows.append((case["rss_bytes"], case["est_total_bytes"], at, fit, replay))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("results", nargs="+", type=Path)
    rows = blended(ap.parse_args().results)
    print(f"{len(rows)} cases whose fit was drawn toward a replay")
    for w in WEIGHTS:
        errs = [(total + (fit + w * (replay - fit) - at) * MiB - rss) / rss for rss, total, at, fit, replay in rows]
        size = sorted(abs(e) for e in errs)
        print(f"w = {w:.2f}: median {100 * statistics.median(size):.2f}%, max {100 * size[-1]:.1f}%, "
              f"median signed {100 * statistics.median(errs):+.2f}%")


if __name__ == "__main__":
    main()
