#!/usr/bin/env python
"""Offline: one calibration's logged runs replayed at the batch (resized by phase, heaplog.rescaled) twice, once with
this checkout's fake traces and once with another checkout's, so that a change to the trace is judged on the same
logs. bench/research/heap_rescale.py compares against real runs, but each of its calls draws new runs, whose own noise
(each run's excess over its log's replay) moves its answer by several percent.

    git worktree add /tmp/before COMMIT
    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/heap_ab.py --other /tmp/before CASE [CASE ...]
    CASE = workload:precision:optimizer:batch[:key=value,...]   (as bench/research/heap_rescale.py takes it)

Per case: the resident-set runs a calibration for the batch makes (calibrate.calibration_batches, the largest
twice), logged; the batch model's trace sizes and phases at those batches and at the batch, from this checkout and
from `--other` (each in its own process, its sources first on the path); each log replayed DRAWS times at the batch
with either and pooled as the estimator pools them (heaplog.pooled). Prints both. A tool for deciding the model,
not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
# the child that dumps the other checkout's traces imports that checkout's sources (SOURCES names it)
ROOT = Path(os.environ.get("HEAP_AB_SOURCES") or HERE)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # mapped_moments, beside this script

import numpy as np  # noqa: E402
from mapped_moments import parse_case  # noqa: E402

from advisor.estimate.estimator import _batch_model  # noqa: E402
from advisor.estimate.model import EstimateRequest  # noqa: E402
from advisor.estimate.resident import heaplog  # noqa: E402
from advisor.estimate.resident.calibrate import _rss_jobs, _run_parallel, calibration_batches, top_runs  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

MiB = 2**20


def _request(case: str):
    spec, prec, opt, batch, args = parse_case(case)
    req = EstimateRequest.of(batch, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                             fused_backward=False, offload_optimizer=False, offload_params=False, optimizer_impl=None)
    return spec, args, batch, req


def dump_sizes(case: str, out: str, batches: list[int]) -> None:
    """The batch model's trace sizes and phases at `batches`, saved to `out` (npz): run in a child process."""
    spec, args, _, req = _request(case)
    bm = _batch_model(load_workload(spec, args), req, cpu=True)
    saved = {}
    for b in batches:
        t = bm.at(b)
        saved[f"sizes{b}"], saved[f"phases{b}"] = t.sizes, t.phases
    np.savez(out, **saved)


def compare(case: str, other: Path) -> None:
    spec, args, batch, req = _request(case)
    sizes = calibration_batches(batch)
    runs = [("rss", b) for b in sizes] + [("rss", sizes[-1], "again", i) for i in range(1, top_runs(0))]
    with tempfile.TemporaryDirectory(prefix="heap-ab-") as logs:
        res = _run_parallel(_rss_jobs(spec, args, req, runs, None, logs))
        batches = sorted(set(sizes) | {batch})
        for name, root in (("this checkout", HERE), (f"{other}", other)):
            out = f"{logs}/trace.npz"
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", case, out, *map(str, batches)],
                           cwd=root, check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(root), "HEAP_AB_SOURCES": str(root)})
            z = np.load(out)
            got = [heaplog.replay_at(res[r].request.heap_log, int(res[r].rss_delta_bytes or 0), None,
                                     z[f"sizes{res[r].request.batch_size}"], z[f"sizes{batch}"],
                                     phases=z[f"phases{res[r].request.batch_size}"]) for r in runs]
            print(f"{case}, traces of {name}: {heaplog.pooled(got) / MiB:.0f} MiB by phase (each log at the batch: "
                  f"{', '.join(f'{np.median(g.at_target) / MiB:.0f}' for g in got)} MiB; the runs' excess: "
                  f"{', '.join(f'{g.excess / MiB:.0f}' for g in got)} MiB)")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--dump":
        dump_sizes(sys.argv[2], sys.argv[3], [int(b) for b in sys.argv[4:]])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--other", type=Path, required=True, help="a checkout of the commit to compare with")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    if heaplog.tools() is None:
        print("heaplog's logger cannot be built here (Linux with glibc and a C compiler needed)")
        return 2
    for case in a.cases:
        compare(case, a.other.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
