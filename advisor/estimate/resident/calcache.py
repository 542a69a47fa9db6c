"""CPU calibrations kept across processes, so a later estimate of the same request on this host
reuses the real runs instead of repeating them (and answering differently by their noise).

One calibration is a JSON file under `data_dir/calibration/runs/`, named by a hash of everything
its runs and its fit depend on: the workload (spec, arguments, fingerprint), the request's knobs,
the host (CPU model, logical CPUs, torch and glibc versions: another allocator or library lays
memory out otherwise) and the estimator's own sources, this file's among them (a fit made, or a file
laid out, by other code is not reused). Where the calibration chose real traces over the fake one,
the two traces sit beside it as .npz files. A file that cannot be read or does not match is ignored
and written again: this is a cache, never the only copy of anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.resident.calibration import Calibration
from advisor.estimate.trace import load_trace, save_trace


def host_identity() -> dict[str, Any]:
    """What decides how this host's resident set answers the same runs."""
    import torch

    from advisor.hardware.sysinfo import cpu_model_name

    return {"cpu": cpu_model_name(), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "libc": "-".join(platform.libc_ver())}


@functools.cache
def estimator_sources() -> str:
    """A hash of advisor/estimate's sources (its subpackages' included), read once per process."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def calibration_key(spec: str, args: dict[str, Any], fingerprint: str, request: dict[str, Any]) -> str:
    payload = json.dumps([spec, args, fingerprint, request, host_identity(), estimator_sources()],
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _dir() -> Path:
    from advisor.settings import get_settings

    return get_settings().data_dir / "calibration" / "runs"


def load(key: str, fake: BatchModel, directory: Path | None = None) -> tuple[Calibration, BatchModel] | None:
    """The calibration kept under `key` and its batch model (`fake` unless it chose real traces), or None."""
    d = directory or _dir()
    path = d / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        calib = Calibration(**{**data["calibration"], "batches": tuple(data["calibration"]["batches"]),
                               "rss": tuple(tuple(p) for p in data["calibration"]["rss"]),
                               "replayed": tuple(tuple(p) for p in data["calibration"].get("replayed", ()))})
        if not calib.used_real_traces:
            return calib, fake
        a, c = data["real_traces"]
        return calib, BatchModel(a=a, trace_a=load_trace(str(d / f"{key}-{a}.npz")),
                                 c=c, trace_c=load_trace(str(d / f"{key}-{c}.npz")))
    except (OSError, ValueError, KeyError, TypeError):  # absent, torn or from another layout: calibrate again
        return None


def save(key: str, calib: Calibration, bm: BatchModel, directory: Path | None = None) -> None:
    """Keep a calibration (and its real traces, where it chose them); written whole or not at all."""
    d = directory or _dir()
    d.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"calibration": asdict(calib)}
    if calib.used_real_traces:
        data["real_traces"] = [bm.a, bm.c]
        for b in (bm.a, bm.c):
            save_trace(bm.at(b), str(d / f"{key}-{b}.npz"))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, d / f"{key}.json")
