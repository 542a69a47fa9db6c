"""How long `advisor plan` takes over the whole space, as a user runs it: each case in fresh processes, the
process's wall time (imports included) and its peak resident set, beside the planner's own timer and how many
configurations it sized and timed.

Goals (docs/planner.md): llama-70b on 64 H100s in at most 10 s; on 1,024 H100s in at most 30 s.

    .venv/bin/python bench/plan_speed.py [--repeats 3] [--out bench/results/plan-speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (label, `advisor plan` arguments, goal in seconds of the process's wall time)
CASES: list[tuple[str, list[str], float]] = [
    ("llama-70b on 64 H100s", ["-w", "llama-70b", "-H", "h100-sxm:8x8"], 10.0),
    ("llama-70b on 1,024 H100s", ["-w", "llama-70b", "-H", "h100-sxm:8x128"], 30.0),
]
COLUMNS = ["case", "command", "wall s (median)", "runs' wall s", "planner s", "memory figures", "steps timed",
           "peak RSS", "goal", "met"]


def run_once(args: list[str]) -> dict[str, Any]:
    """One fresh `advisor plan ... --json` process, reaped here for its resource usage: its wall seconds, peak
    resident set and the plan's own figures."""
    cmd = [str(ROOT / ".venv" / "bin" / "advisor"), "plan", *args, "--json"]
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        pid = os.posix_spawn(cmd[0], cmd, dict(os.environ), file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1)])
        _, status, usage = os.wait4(pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)})")
    plan = json.loads(text)
    return {"wall_s": wall, "planner_s": plan["seconds"], "considered": plan["considered"], "timed": plan["timed"],
            "fits": plan["fits"], "top": plan["plans"][0]["config"] if plan["plans"] else None,
            "peak_rss_bytes": int(usage.ru_maxrss) * 1024}


def run_case(label: str, args: list[str], goal_s: float, repeats: int) -> dict[str, Any]:
    runs = [run_once(args) for _ in range(repeats)]
    wall = statistics.median(r["wall_s"] for r in runs)
    return {"label": label, "args": args, "goal_s": goal_s, "runs": runs, "wall_s": wall,
            "planner_s": statistics.median(r["planner_s"] for r in runs), "met": wall <= goal_s,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs)}


def meta(argv: list[str]) -> dict[str, Any]:
    from bench.estimate_accuracy import _load_avg, machine, source_state

    source = source_state()
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "argv": argv,
            "command": " ".join([".venv/bin/python", "bench/plan_speed.py", *argv]),
            "load_avg_start": _load_avg(), "source": source, "machine": machine()}


def markdown(res: dict[str, Any]) -> str:
    from bench.estimate_accuracy import _md_table

    m = res["meta"]
    dirty = " with uncommitted changes" if m["source"]["dirty"] else ""
    rows = [[c["label"], f"`advisor plan {' '.join(c['args'])}`", f"{c['wall_s']:.2f}",
             ", ".join(f"{r['wall_s']:.2f}" for r in c["runs"]), f"{c['planner_s']:.2f}",
             f"{c['runs'][0]['considered']:,}", f"{c['runs'][0]['timed']:,}",
             f"{c['peak_rss_bytes'] / 2**20:,.0f} MiB", f"≤ {c['goal_s']:.0f} s",
             "yes" if c["met"] else "NO"] for c in res["cases"]]
    return "\n".join([
        f"Run {m['started']} on {m['machine']['cpu']} ({m['cpu_count']} CPUs, load average "
        f"{m['load_avg_start'][0]:.1f} at the start, {m['load_avg_end'][0]:.1f} at the end), commit "
        f"`{m['source']['git_head']}`{dirty}, {m['seconds']:.0f} s: `{m['command']}`.", "",
        f"Each case {res['repeats']} fresh processes, one after another: the process's wall time (Python, the "
        "advisor's imports and the search, which is what the goal counts), the planner's own timer of the search "
        "(`seconds` in `--json`), the configurations whose memory it sized and whose step it timed, and the "
        "process's peak resident set.", "",
        _md_table(COLUMNS, rows), "",
        f"Goal met in {sum(c['met'] for c in res['cases'])} of {len(res['cases'])} cases.", ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per case (3)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan-speed.json")
    args = ap.parse_args(argv)
    from bench.estimate_accuracy import _atomic_write, _load_avg

    t0 = time.monotonic()
    res: dict[str, Any] = {"meta": meta(argv), "repeats": args.repeats, "cases": []}
    for label, case_args, goal in CASES:
        res["cases"].append(run_case(label, case_args, goal, args.repeats))
        print(f"{label}: {res['cases'][-1]['wall_s']:.2f} s (goal ≤ {goal:.0f} s)", flush=True)
    res["meta"].update(seconds=time.monotonic() - t0, load_avg_end=_load_avg())
    _atomic_write(args.out, json.dumps(res, indent=2))
    _atomic_write(args.out.with_suffix(".md"), markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
