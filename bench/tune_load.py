#!/usr/bin/env python
"""The tuner on a host with other work on it: what the trials measure, and how long the run takes,
quiet and beside busy processes, with the trials run by Ray Tune (`--executor ray`: an inline run has
no Ray workers) at niceness 0 (the tuner's default) and at Ray's own default of 15 (RAY_worker_niceness).

    .venv/bin/python bench/tune_load.py [--load 1] [--trials 4] [--out bench/results/tune-load.json]

Each scenario runs `advisor tune` on tiny-gpt2 (seq_len 128) with bench/spaces/tune-load.yaml by
brute force (the same 4 configurations every time) in a fresh data dir; a loaded scenario first
starts --load busy Python loops at niceness 0 and stops them after. Reported per scenario: the
run's wall time, the sum of the trials' wall times, and each configuration's tokens/s as a ratio
to the quiet run's, with the niceness its rank recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SPACE = ROOT / "bench" / "spaces" / "tune-load.yaml"
# name, busy loops, RAY_worker_niceness
SCENARIOS = [("quiet", 0, "0"), ("loaded, trials at niceness 0", None, "0"),
             ("loaded, trials at niceness 15", None, "15")]


def run_scenario(loops: int, niceness: str, trials: int) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="tl-", dir="/tmp"))  # short: Ray's socket paths live under it
    db = f"sqlite:///{data / 'advisor.db'}"
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data), "RAY_worker_niceness": niceness}
    cmd = [sys.executable, "-m", "advisor.cli", "tune", "-w", "tiny-gpt2", "-a", "seq_len=128", "-H", "cpu",
           "--space", str(SPACE), "--sampler", "brute-force", "--trials", str(trials), "--min-time", "1",
           "--executor", "ray", "--db", db, "--json"]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600, check=False)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"advisor tune failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(proc.stdout)
    from advisor.store import TrialQuery, open_store

    with open_store(db) as store:
        rows = store.query_trials(TrialQuery(sort="id"))
    return {
        "loops": loops, "worker_niceness": niceness, "process_wall_s": wall, "run_wall_s": summary["wall_s"],
        "trial_s": summary["trial_s"], "statuses": summary["statuses"],
        "trials": [{"config": f"batch {r.config.batch_size}, workers {r.config.num_workers}",
                    "tokens_per_s": r.tokens_per_s, "wall_s": r.result.wall_s if r.result else None,
                    "niceness": r.result.environment.niceness if r.result and r.result.environment else None,
                    "notes": r.result.notes if r.result else []} for r in rows],
    }


def markdown(res: dict[str, Any]) -> str:
    quiet = {t["config"]: t["tokens_per_s"] for t in res["scenarios"][0]["trials"]}
    lines = [f"## The tuner beside other work ({res['meta']['started']})", "",
             f"`bench/tune_load.py --load {res['meta']['load']} --trials {res['meta']['trials']}` on "
             f"{res['meta']['cpu']} ({res['meta']['cpu_count']} CPUs), git {res['meta']['git']}: tiny-gpt2 (seq_len "
             "128), bench/spaces/tune-load.yaml by brute force, a fresh data dir each.", "",
             "| scenario | run wall s | trials' wall s | orchestration | tokens/s vs quiet, per configuration "
             "(median) | rank niceness |",
             "|---|---|---|---|---|---|"]
    for name, sc in zip(res["names"], res["scenarios"]):
        ratios = {t["config"]: t["tokens_per_s"] / quiet[t["config"]] for t in sc["trials"]
                  if t["tokens_per_s"] and quiet.get(t["config"])}
        per = ", ".join(f"{c}: {r:.2f}" for c, r in sorted(ratios.items()))
        med = statistics.median(ratios.values()) if ratios else float("nan")
        nice = sorted({t["niceness"] for t in sc["trials"]}, key=str)
        over = (sc["run_wall_s"] - sc["trial_s"]) / sc["run_wall_s"] if sc["run_wall_s"] else float("nan")
        lines.append(f"| {name} | {sc['run_wall_s']:.0f} | {sc['trial_s']:.0f} | {over:.0%} | {per} ({med:.2f}) | "
                     f"{', '.join(map(str, nice))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from advisor.hardware.sysinfo import cpu_model_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=int, default=1, help="busy loops beside the loaded scenarios (default 1)")
    ap.add_argument("--trials", type=int, default=4, help="configurations per scenario (default 4: the whole grid)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tune-load.json")
    args = ap.parse_args(argv)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    res: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "load": args.load,
                                    "trials": args.trials, "cpu": cpu_model_name(),
                                    "cpu_count": os.cpu_count(), "git": git},
                           "names": [], "scenarios": []}
    for name, loops, nice in SCENARIOS:
        print(f"{name} ...", flush=True)
        sc = run_scenario(args.load if loops is None else loops, nice, args.trials)
        res["names"].append(name)
        res["scenarios"].append(sc)
        print(f"  run {sc['run_wall_s']:.0f} s, trials {sc['trial_s']:.0f} s: "
              + "; ".join(f"{t['config']} {t['tokens_per_s'] or 0:.0f} tok/s (nice {t['niceness']})"
                          for t in sc["trials"]),
              flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
