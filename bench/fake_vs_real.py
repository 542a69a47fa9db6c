#!/usr/bin/env python
"""The estimator's trace on fake tensors against the same trace on real ones: their live-tensor peaks.

    .venv/bin/python bench/fake_vs_real.py [SPEC:BATCH ...] [--precision fp32] [--optimizer adamw]

A target without real runs of its own (a GPU, any catalog device) has only the fake trace, so where
fake and real disagree its estimate is off by as much. On this CPU the calibration would turn to the
real traces instead (advisor/estimate/calibrate.py, AGREEMENT), which hides the disagreement from the
CPU benches. By default: the held-out models that build layers with copy.deepcopy (torch's
nn.Transformer, nn.TransformerEncoder), whose fake traces counted every use of a copied parameter as a
new allocation until 2ca7af9. A tool for reading the tracer, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import time

from advisor.config import OptimizerKind, Precision
from advisor.errors import EstimateError
from advisor.estimate.trace import trace_training
from advisor.workload import load_workload

DEFAULT = ["bench/workloads/fresh.py:seq2seq:8", "bench/workloads/fresh2.py:ftt:256", "bench/workloads/unseen.py:encoder:8",
           "bench/workloads/fresh3.py:ctc:8"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", default=DEFAULT, help="workload spec and batch size, as SPEC:BATCH")
    p.add_argument("--precision", default="fp32", choices=[x.value for x in Precision])
    p.add_argument("--optimizer", default="adamw", choices=[x.value for x in OptimizerKind])
    args = p.parse_args()
    kw = {"precision": Precision(args.precision), "optimizer": OptimizerKind(args.optimizer)}
    print(f"{'workload':44} {'batch':>6} {'fake peak B':>14} {'real peak B':>14} {'fake vs real':>12} {'fake s':>7}")
    for case in args.cases:
        spec, _, batch = case.rpartition(":")
        wl = load_workload(spec, {})
        t0 = time.perf_counter()
        try:
            fake = trace_training(wl, int(batch), fake=True, **kw)
            seconds = time.perf_counter() - t0
            real = trace_training(wl, int(batch), fake=False, **kw)
        except EstimateError as exc:  # a model this commit's tracer cannot take
            print(f"{spec:44} {batch:>6} {exc}")
            continue
        err = (fake.peak_bytes - real.peak_bytes) / real.peak_bytes
        print(f"{spec:44} {batch:>6} {fake.peak_bytes:>14,} {real.peak_bytes:>14,} {err:>+12.2%} {seconds:>7.1f}")


if __name__ == "__main__":
    main()
