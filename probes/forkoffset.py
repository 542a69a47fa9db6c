"""How far a forked trial rank's CPU peak falls below DESIGN.md's fresh-process peak, on this host.

A trial rank is forked from a server that imported torch's compiler stack (probes/forkserver.py
PRELOAD), which a fresh process imports while it builds its first optimizer: those pages are in a
rank's resident set before build_model and so never in its increase. The rank's protocol peak
(probes/child.py `_protocol_steps`: own batches, no DataLoader) plus this offset is the fresh
process's. The offset is measured once per host, torch and server (one fresh run and one rank of a
reference workload, side by side) and kept under the data dir.

Measured here (2-vCPU VM, torch 2.13.0+cpu; fresh minus rank, medians of 3): tiny-mlp b8 63 MB,
tiny-gpt2 b64 61 MB, resnet18 (64 px) b32 58 MB, mlp b256 39 MB. The import alone is 75 MB; what
the steps then allocate reuses some of the heap the import left free in a fresh process, by as much
as the workload's allocations fit in it. So a converted peak is within about 25 MB of the fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from probes.forkserver import PRELOAD

REFERENCE = ("tiny-mlp", 8)  # builds and steps in a fraction of a second; its fresh runs repeat within 0.3 MB


def _key() -> str:
    from advisor.estimate.calcache import host_identity

    payload = json.dumps([host_identity(), PRELOAD, REFERENCE], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _path() -> Path:
    from advisor.settings import get_settings

    return get_settings().data_dir / "calibration" / f"fork-offset-{_key()}.json"


def fork_offset_bytes() -> int | None:
    """Fresh-process peak minus a forked rank's protocol peak, for this host (bytes); None where the
    reference could not be measured (the reason is logged)."""
    path = _path()
    try:
        return int(json.loads(path.read_text())["offset_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    offset = measure_offset()
    if offset is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fork-offset-")
        with os.fdopen(fd, "w") as f:
            json.dump({"offset_bytes": offset, "reference": REFERENCE}, f)
        os.replace(tmp, path)
    return offset


def measure_offset() -> int | None:
    """One fresh-process run and one forked rank of the reference, at once (bytes)."""
    import logging

    from advisor.errors import AdvisorError
    from advisor.measure import MeasureRequest, measure
    from probes.config import TrialBudget
    from probes.runner import run_trial

    name, batch = REFERENCE
    budget = TrialBudget(warmup_steps=2, min_steps=1, min_time_s=0.0, settle_s=0.0, timeout_s=120.0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        fresh = pool.submit(measure, MeasureRequest(workload=name, batch_size=batch, mode="rss"))
        rank = pool.submit(run_trial, name, {"batch_size": batch}, hardware="cpu", budget=budget, estimate=False,
                           count_ops=False, record_peak=False)
        try:
            fresh_bytes = fresh.result().rss_delta_bytes
        except AdvisorError as exc:
            logging.getLogger(__name__).warning("fork offset not measured: %s", exc)
            return None
        peak = rank.result().peak_memory
    if fresh_bytes is None or peak is None or peak.cpu_protocol_rss_bytes is None:
        logging.getLogger(__name__).warning("fork offset not measured: the reference trial reported no protocol peak")
        return None
    return int(fresh_bytes - peak.cpu_protocol_rss_bytes)
