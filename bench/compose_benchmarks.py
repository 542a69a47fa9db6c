#!/usr/bin/env python
"""Write BENCHMARKS.md from the markdown that bench/estimate_accuracy.py and bench/tune_bench.py leave
in bench/results/.

    .venv/bin/python bench/compose_benchmarks.py

bench/results/ is committed (its databases are not), so this file can be rewritten from a checkout.
A section whose results file is missing (an older run's, from before the results were kept) keeps
its text in the current BENCHMARKS.md. Hand-written readings of a section live in
bench/notes/<section>.md and are appended after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HEADER = ROOT / "bench" / "BENCHMARKS.header.md"
# Written by hand from bench/calibration_accuracy.py's run (its table pasted in): appended as it is.
CALIBRATION = ROOT / "bench" / "BENCHMARKS.calibration.md"


NOTES = ROOT / "bench" / "notes"
BENCHMARKS = ROOT / "BENCHMARKS.md"


def _cut(text: str, title: str) -> str | None:
    """From the line '## {title}...' to the next '## ' heading, or None."""
    start = text.find(f"## {title}")
    if start < 0:
        return None
    end = text.find("\n## ", start + 3)
    return text[start:end if end > 0 else None].strip() + "\n"


def _section(md: Path, title: str, notes: str | None = None) -> str:
    """The part of a results markdown from heading `title` to the next '## ' heading, then the
    section's notes (bench/notes/<notes>.md) if any. Without the results file: the section as the
    current BENCHMARKS.md has it (notes included)."""
    if not md.exists():
        kept = _cut(BENCHMARKS.read_text(), title) if BENCHMARKS.exists() else None
        return kept or f"_{md.name} not found: run the command above._\n"
    body = _cut(md.read_text(), title) or f"_no '{title}' section in {md.name}_\n"
    note = NOTES / f"{notes}.md" if notes else None
    return body + ("\n" + note.read_text().strip() + "\n" if note is not None and note.exists() else "")


def _tuner() -> str:
    """bench/tune_bench.py's section: the full run's, else the quick run's, said so."""
    full, quick = RESULTS / "tune.md", RESULTS / "tune-quick.md"
    if full.exists() or not quick.exists():
        return _section(full, "Tuner", notes="tuner")
    body = _section(quick, "Tuner").split("\n", 1)
    return f"{body[0]}\n\nQuick mode only (`--quick`: small grids, 2 seeds); the full run is still to do.\n{body[1]}"


def _estimator(acc: Path) -> list[str]:
    """The header and bench/estimate_accuracy.py's sections; without its results, this part of the
    current BENCHMARKS.md as it stands (up to the sections appended apart: the unseen workloads', the calibration)."""
    if not acc.exists() and BENCHMARKS.exists():
        text = BENCHMARKS.read_text()
        ends = [text.find("\n## Workloads outside the presets")]
        if CALIBRATION.exists():
            ends.append(text.find(f"\n{CALIBRATION.read_text().strip().splitlines()[0]}"))
        end = min((e for e in ends if e > 0), default=-1)
        return [text[:end if end > 0 else None].strip() + "\n"]
    parts = [HEADER.read_text().strip() + "\n"]
    if acc.exists():
        run = acc.read_text().splitlines()[2]
        parts.append("### Run\n\n" + run.replace("(in progress)", "(stopped there)") + "\n")
    parts.append(_section(acc, "Summary"))
    parts.append(_section(acc, "Cases"))
    parts.append(_section(RESULTS / "speed.md", "Estimator speed"))
    parts.append(_section(RESULTS / "maxbatch.md", "Largest batch under a memory cap", notes="maxbatch"))
    quick = RESULTS / "accuracy-quick.md"
    if quick.exists():  # never from BENCHMARKS.md itself: that would nest the section in itself on every run
        parts.append("Quick mode (`--quick`), earlier in the session:\n\n"
                     + _section(quick, "Largest batch under a memory cap").split("\n", 1)[1])
    return parts


def _outside(kind: str, title: str) -> str:
    """`estimate_accuracy.py --set {kind}`'s summary and cases, as one section ('## {title}'), then
    bench/notes/{kind}.md; without its results, that section as BENCHMARKS.md has it."""
    md, note = RESULTS / f"accuracy-{kind}.md", NOTES / f"{kind}.md"
    command = (f"```bash\n.venv/bin/python bench/estimate_accuracy.py --set {kind} --skip maxbatch,speed "
               f"--out bench/results/accuracy-{kind}.json\n```\n")
    if not md.exists():
        if not note.exists():
            return _section(md, title)
        return f"## {title}\n\n{command}\n_Not run yet ({md.name} not found)._\n\n{note.read_text().strip()}\n"
    run = md.read_text().splitlines()[2].replace("(in progress)", "(stopped there)")
    body = [f"## {title}\n", command, run + "\n"]
    for part in ("Summary", "Cases"):
        body.append("#" + _section(md, part))
    return "\n".join(body) + ("\n" + note.read_text().strip() + "\n" if note.exists() else "")


def main() -> int:
    parts = _estimator(RESULTS / "accuracy.md")
    parts.append(_outside("unseen", "Workloads outside the presets"))
    parts.append(_outside("fresh", "Workloads written before any estimate of them was seen"))
    parts.append(_outside("kinds", "Model kinds no other set has"))
    parts.append(_outside("fresh2", "Workloads written before any estimate of them was seen: session 37's"))
    parts.append(_outside("fresh3", "Workloads written before any estimate of them was seen: session 46's"))
    parts.append(_outside("fresh4", "Workloads written before any estimate of them was seen: session 48's"))
    parts.append(_outside("fresh5", "Workloads written before any estimate of them was seen: session 49's"))
    parts.append(_outside("fresh6", "Workloads written before any estimate of them was seen: session 50's"))
    parts.append(_outside("fresh7", "Workloads written before any estimate of them was seen: session 51's"))
    parts.append(_outside("fresh8", "Workloads written before any estimate of them was seen: session 52's"))
    parts.append(_outside("fresh9", "Workloads written before any estimate of them was seen: session 56's"))
    if CALIBRATION.exists():
        parts.append(CALIBRATION.read_text())
    # bench/estimate_accuracy_cuda.py, on a lent GPU machine
    parts.append(_section(RESULTS / "accuracy-cuda.md", "Estimator accuracy on CUDA", notes="cuda"))
    # the same bench on an H200 (session 36), measured afresh: its own section, after the H100's
    h200 = _section(RESULTS / "accuracy-cuda-h200.md", "Estimator accuracy on CUDA", notes="cuda-h200")
    parts.append(h200.replace("## Estimator accuracy on CUDA", "## Estimator accuracy on CUDA: H200", 1))
    parts.append(_section(RESULTS / "trials.md", "Measured trials", notes="trials"))  # bench/trial_bench.py
    parts.append(_section(RESULTS / "trials-cuda.md", "Measured trials on CUDA", notes="trials-cuda"))
    parts.append(_tuner())
    parts.append(_section(RESULTS / "tune-load.md", "The tuner beside other work", notes="tune-load"))  # bench/tune_load.py
    parts.append(_section(RESULTS / "api_load.md", "HTTP API under load"))  # bench/api_load.py
    BENCHMARKS.write_text("\n".join(parts))
    print(BENCHMARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
