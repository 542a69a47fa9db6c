#!/usr/bin/env python
"""Offline: whether the estimator's two fake traces of each accuracy case make the same allocations.

    .venv/bin/python bench/research/batch_alignment.py [--set presets|unseen|fresh|kinds|all] [--only W1,W2]
        [--out FILE.jsonl]

The batch model (advisor/estimate/batchmodel.py) extrapolates every allocation from two traces at
batch sizes a and c when the traces make the same allocations in the same order; otherwise it falls
back to interpolating a few peak moments, which can put the long-lived peak wrong away from the
traced batches (a copy probe's size threshold crossed between the traces put vit-b16 bf16 b16 at
-20.6% against the measured resident set). A change to what the tracer records can move this
without moving the peak at the traced batch; this checks every case of the accuracy sets (the
estimator's traces for a CPU target, with its kernels probed), nothing measured. One JSON line per
case: aligned or not, events in each trace, op shapes probed, allocations of 0 bytes in one trace
only. Not a benchmark of a goal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.estimate_accuracy import (  # noqa: E402
    FRESH_WORKLOADS,
    KINDS_WORKLOADS,
    OPTIMIZERS,
    PRECISIONS,
    UNSEEN_WORKLOADS,
    WORKLOADS,
)

SETS = {"presets": WORKLOADS, "unseen": UNSEEN_WORKLOADS, "fresh": FRESH_WORKLOADS, "kinds": KINDS_WORKLOADS}


def _zero_in_one(bm) -> int | None:
    """Allocations of 0 bytes in one trace and not in the other (a probe that found scratch at one batch
    size only), which would make the traces' allocations differ. None where misaligned."""
    if bm.aligned is None:
        return None
    _, _, size_a, size_c, _, _ = bm.aligned
    return int(((size_a == 0) != (size_c == 0)).sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=(*SETS, "all"), default="all")
    ap.add_argument("--only", default=None, help="comma-separated workload names (as the accuracy bench names them)")
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    args = ap.parse_args(argv)

    import logging

    logging.getLogger("advisor").setLevel(logging.ERROR)
    from advisor.estimate.estimator import _batch_model
    from advisor.estimate.model import EstimateRequest
    from advisor.workload import load_workload

    os.chdir(ROOT)  # the other sets' workloads are named by their path in the tree
    sets = SETS if args.set == "all" else {args.set: SETS[args.set]}
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    out = open(args.out, "w") if args.out else None
    misaligned = total = 0
    for name, cases in sets.items():
        for wc in cases:
            if only is not None and wc.workload not in only:
                continue
            wl = load_workload(wc.workload, wc.args)
            for prec in PRECISIONS:
                for opt in OPTIMIZERS:
                    for b in wc.batches:
                        t0 = time.perf_counter()
                        req = EstimateRequest.of(b, precision=prec, optimizer=opt, strategy="single")
                        row = {"set": name, "workload": wc.workload, "args": wc.args, "precision": prec,
                               "optimizer": opt,
                               "batch": b}
                        try:
                            bm = _batch_model(wl, req, cpu=True)
                        except Exception as exc:  # noqa: BLE001 - a model the fake trace cannot follow (the estimator measures it)
                            row["untraceable"] = f"{type(exc).__name__}: {exc}"[:200]
                        else:
                            row.update({"traced": [bm.a, bm.c], "aligned": bm.aligned is not None,
                                        "events": [len(bm.trace_a.sizes), len(bm.trace_c.sizes)],
                                        "probed_copies": [bm.trace_a.probed_copies, bm.trace_c.probed_copies],
                                        "sized_kernels": [bm.trace_a.sized_kernels, bm.trace_c.sized_kernels],
                                        "zero_in_one": _zero_in_one(bm)})
                            total += 1
                            misaligned += not row["aligned"]
                        row["seconds"] = round(time.perf_counter() - t0, 2)
                        line = json.dumps(row)
                        print(line, flush=True)
                        if out:
                            out.write(line + "\n")
                            out.flush()
    print(f"{misaligned} of {total} batch models misaligned (untraceable ones not counted)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
