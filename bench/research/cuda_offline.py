#!/usr/bin/env python
"""Offline, without a GPU: the kept CUDA cases estimated again with this checkout's code for the catalog GPU they
were measured on, against their kept real peaks (max_memory_reserved / max_memory_allocated).

    .venv/bin/python bench/research/cuda_offline.py [--results bench/results/accuracy-cuda-h200.json] [--hardware h200]
        [--workloads bert-base,gpt2-small,dlrm,mlp] [--out F.json]

Only for workloads whose estimate on the GPU itself sizes no cuDNN kernel on it: on a GPU the estimator runs
cuDNN's convolutions and LSTMs, and reductions, once on the device to size their workspaces
(scratch_cuda.cuda_scratch); for a catalog GPU it cannot, so convolution nets, LSTMs and ViT's patchify estimate
otherwise here than on the GPU. Reductions' scratch it works out for the catalog GPU (cuda_reduce.py; without it
mlp was 0% to -27% off here).
The kept figure beside each case is the estimate the GPU run made. A check of a trace change against real
peaks between leases, not a GPU measurement: bench/estimate_accuracy_cuda.py on a GPU is that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory  # noqa: E402
from advisor.hardware import get_hardware  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "accuracy-cuda-h200.json")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--workloads", default="bert-base,gpt2-small,dlrm,mlp")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    hw, keep = get_hardware(a.hardware), set(a.workloads.split(","))
    rows = []
    for c in json.loads(a.results.read_text())["cases"]:
        if c["workload"] not in keep or not c.get("reserved_bytes"):
            continue
        e = estimate_memory(c["workload"], hw,
                            EstimateRequest(batch_size=c["batch_size"], precision=c["precision"],
                                            optimizer=c["optimizer"]),
                            EstimateOptions(measured=False), workload_args=c["workload_args"])
        row = {"key": c["key"], "reserved": e.total_bytes / c["reserved_bytes"] - 1,
               "allocated": e.allocated_bytes / c["alloc_bytes"] - 1, "on_the_gpu": c["errors"]["ours_vs_reserved"]}
        rows.append(row)
        print(f"{c['key']:48s} reserved {row['reserved']:+.1%} (the GPU run's estimate {row['on_the_gpu']:+.1%}); "
              f"allocated {row['allocated']:+.1%}", flush=True)
    if not rows:
        sys.exit(f"no kept case of {sorted(keep)} in {a.results}")
    for name in ("reserved", "allocated"):
        errs = [abs(r[name]) for r in rows]
        print(f"{name}: {len(rows)} cases, median {statistics.median(errs):.2%}, max {max(errs):.1%}")
    if a.out:
        a.out.write_text(json.dumps({"results": str(a.results.relative_to(ROOT)) if a.results.is_relative_to(ROOT)
                                     else a.results.name, "hardware": a.hardware, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
