#!/usr/bin/env python
"""Where the resident-set peak's run-to-run spread comes from: one case measured in fresh processes
(docs/design.md's protocol, `advisor.measure` in rss mode) with each source of randomness a fresh process has
left on or taken away.

    .venv/bin/python bench/research/rss_spread.py [--workload mlp] [--batch 1024] [--optimizer sgd-momentum]
        [--precision fp32] [--runs 8] [--seeds 8] [--out FILE.json]

Variants, `--runs` runs each:
- `fresh`: as the benches and the estimator's calibration run it (Python's string hashes salted at
  random, address space laid out at random);
- `hash seed 0`: PYTHONHASHSEED=0, so sets and dicts of strings iterate in one order in every run;
- `no ASLR`: under `setarch -R` (personality ADDR_NO_RANDOMIZE), so every mapping and the heap start at
  the same addresses (objects hashed by address then land alike too);
- `both`.
Then `--seeds` hash seeds, each run twice without ASLR: whether each seed gives one figure of its own.
A tool for reading the benches' noise, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.measure import MeasureRequest, MeasureResult  # noqa: E402
from advisor.procmem import malloc_env  # noqa: E402

MIB = 2**20


def run_once(req: MeasureRequest, hash_seed: int | None, no_aslr: bool) -> int:
    """The resident-set increase of one fresh `advisor.measure` process (bytes)."""
    env = malloc_env(req.mmap_threshold)  # as measure.measure builds it
    env.pop("PYTHONHASHSEED", None)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = str(hash_seed)
    cmd = [sys.executable, "-m", "advisor.measure", req.model_dump_json()]
    if no_aslr:
        cmd = ["setarch", os.uname().machine, "-R", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return MeasureResult.model_validate_json(proc.stdout.strip().splitlines()[-1]).rss_delta_bytes


def summary(runs: list[int]) -> dict[str, float]:
    med = statistics.median(runs)
    return {"min_mib": min(runs) / MIB, "median_mib": med / MIB, "max_mib": max(runs) / MIB,
            "range_of_median": (max(runs) - min(runs)) / med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--optimizer", default="sgd-momentum")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if shutil.which("setarch") is None:
        sys.exit("setarch (util-linux) is needed to run without ASLR")
    req = MeasureRequest(workload=args.workload, batch_size=args.batch, optimizer=args.optimizer,
                         precision=args.precision, mode="rss")
    rows: list[dict] = []
    print(f"{args.workload} {args.precision} {args.optimizer} b{args.batch}, resident-set increase (MiB)")
    print("| variant | runs | min | median | max | range / median |\n|---|---|---|---|---|---|")
    for name, seed, no_aslr in (("fresh", None, False), ("hash seed 0", 0, False), ("no ASLR", None, True),
                                ("both", 0, True)):
        runs = [run_once(req, seed, no_aslr) for _ in range(args.runs)]
        rows.append({"variant": name, "runs": runs, **summary(runs)})
        s = rows[-1]
        print(f"| {name} | {' '.join(f'{r / MIB:.0f}' for r in runs)} | {s['min_mib']:.0f} | {s['median_mib']:.0f} | "
              f"{s['max_mib']:.0f} | {s['range_of_median']:.1%} |", flush=True)
    per_seed = {}
    print("\n| hash seed, no ASLR | run 1 | run 2 |\n|---|---|---|")
    for seed in range(args.seeds):
        per_seed[seed] = [run_once(req, seed, True) for _ in range(2)]
        print(f"| {seed} | {per_seed[seed][0] / MIB:.0f} | {per_seed[seed][1] / MIB:.0f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"request": req.model_dump(), "variants": rows,
                                        "per_seed_no_aslr": per_seed}, indent=1))


if __name__ == "__main__":
    main()
