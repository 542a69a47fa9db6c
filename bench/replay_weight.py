"""The heap's replay at the batch against the fit's line, offline, from estimate_accuracy.py's results.

Where an estimate replayed its calibration runs' heap at the batch (calibrate.replay_at_batch), its note
gives the resident set the estimate took, the fit's line there and the replay's prediction (MiB). This
prints, for each such case, the estimate, the line alone and the replay alone against the measured peak
(the median of 3 runs), and what the estimate would have been had the replay counted as w runs
(Calibration.at_batch draws the line toward it by w / (w + 1)): recomputed from the two figures, not rerun.

    .venv/bin/python bench/replay_weight.py bench/results/accuracy.json [more results ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

MIB = 2**20
_NOTE = re.compile(r"resident set at batch \d+: (\d+) MiB, the fit's (\d+) MiB.*glibc[^(]*\((\d+) MiB")
WEIGHTS = (0.0, 1.0, 2.0, 3.0, 5.0, float("inf"))


def replayed_cases(path: Path) -> list[dict]:
    """name, runs (MiB), measured, estimate, line and replay (bytes) of each case whose estimate replayed."""
    out = []
    for c in json.loads(path.read_text())["cases"]:
        note = next((n for n in c.get("notes", []) if "replayed through this machine's glibc" in n), None)
        m = _NOTE.search(note or "")
        if not m or not c.get("rss_bytes") or not c.get("est_total_bytes"):
            continue
        taken, _, replay = (int(x) for x in m.groups())
        est = c["est_total_bytes"]
        out.append({"case": f"{c['workload'].split(':')[-1]} {c['precision']} {c['optimizer']} b{c['batch_size']}",
                    "runs": [r / MIB for r in c.get("rss_runs", [])], "measured": c["rss_bytes"], "estimate": est,
                    "line": c.get("est_total_bytes_no_replay", est), "replay": est + (replay - taken) * MIB})
    return out


def blended(case: dict, w: float) -> float:
    share = 1.0 if w == float("inf") else w / (w + 1)
    return case["line"] + share * (case["replay"] - case["line"])


def _summary(errors: list[float]) -> str:
    a = [abs(e) * 100 for e in errors]
    return f"median {statistics.median(a):.2f}%, max {max(a):.1f}%, mean {statistics.mean(a):.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.results:
        cases = replayed_cases(path)
        print(f"\n{path} ({len(cases)} cases replayed)\n")
        if not cases:
            continue
        print("| case | runs at the batch (MiB) | ours | the line alone (ablation) | the replay alone |")
        print("|---|---|---|---|---|")
        for c in cases:
            errs = [c[k] / c["measured"] - 1 for k in ("estimate", "line", "replay")]
            print(f"| {c['case']} | {', '.join(f'{r:.0f}' for r in c['runs'])} | "
                  + " | ".join(f"{e * 100:+.1f}%" for e in errs) + " |")
        print()
        for w in WEIGHTS:
            label = "replay alone" if w == float("inf") else "line alone" if w == 0 else f"replay as {w:g} run(s)"
            print(f"- {label}: {_summary([blended(c, w) / c['measured'] - 1 for c in cases])}")


if __name__ == "__main__":
    main()
