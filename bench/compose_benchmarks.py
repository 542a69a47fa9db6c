#!/usr/bin/env python
"""Write BENCHMARKS.md from the markdown that bench/estimate_accuracy.py and bench/tune_bench.py leave
in bench/results/.

    .venv/bin/python bench/compose_benchmarks.py

The results folder is not committed; BENCHMARKS.md is the record (command, machine, date, tables).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HEADER = ROOT / "bench" / "BENCHMARKS.header.md"
# Written by hand from bench/calibration_accuracy.py's run (its table pasted in): appended as it is.
CALIBRATION = ROOT / "bench" / "BENCHMARKS.calibration.md"


def _section(md: Path, title: str) -> str:
    """The part of a results markdown from heading `title` to the next '## ' heading."""
    if not md.exists():
        return f"_{md.name} not found: run the command above._\n"
    text = md.read_text()
    start = text.find(f"## {title}")
    if start < 0:
        return f"_no '{title}' section in {md.name}_\n"
    end = text.find("\n## ", start + 3)
    return text[start:end if end > 0 else None].strip() + "\n"


def _tuner() -> str:
    """bench/tune_bench.py's section: the full run's, else the quick run's, said so."""
    full, quick = RESULTS / "tune.md", RESULTS / "tune-quick.md"
    if full.exists() or not quick.exists():
        return _section(full, "Tuner")
    body = _section(quick, "Tuner").split("\n", 1)
    return f"{body[0]}\n\nQuick mode only (`--quick`: small grids, 2 seeds); the full run is still to do.\n{body[1]}"


def main() -> int:
    acc = RESULTS / "accuracy.md"
    parts = [HEADER.read_text().strip() + "\n"]
    if acc.exists():
        run = acc.read_text().splitlines()[2]
        # the snapshot folder is a path on the benchmarking machine: keep only the source hash
        run = re.sub(r"advisor sources: \S+ \(git [^,]*,", "advisor sources: a snapshot of the tree (source", run)
        parts.append("### Run\n\n" + run.replace("(in progress)", "(stopped there)") + "\n")
    parts.append(_section(acc, "Summary"))
    parts.append(_section(acc, "Cases"))
    parts.append(_section(RESULTS / "speed.md", "Estimator speed"))
    parts.append(_section(RESULTS / "maxbatch.md", "Largest batch under a memory cap"))
    parts.append("Quick mode (`--quick`), earlier in the session:\n\n"
                 + _section(RESULTS / "accuracy-quick.md", "Largest batch under a memory cap").split("\n", 1)[1])
    if CALIBRATION.exists():
        parts.append(CALIBRATION.read_text())
    parts.append(_section(RESULTS / "trials.md", "Measured trials"))  # bench/trial_bench.py
    parts.append(_tuner())
    parts.append(_section(RESULTS / "api_load.md", "HTTP API under load"))  # bench/api_load.py
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))
    print(ROOT / "BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
