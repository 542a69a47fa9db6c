"""Export of a chosen configuration (`advisor results export`): JSON (config + workload), a Python
training script, or the launch command (torchrun, under numactl or taskset when pinned)."""

from __future__ import annotations

import json
import shlex
from typing import Any, Literal

from advisor.errors import SpecError
from probes.config import Pinning, TrainingConfig

FORMATS = ("json", "python", "torchrun")
Format = Literal["json", "python", "torchrun"]
EXPORT_VERSION = 1  # bumped when the JSON layout changes


def export_json(config: TrainingConfig, workload_spec: str, workload_args: dict[str, Any]) -> str:
    """The configuration and the workload it was chosen for, as one JSON document."""
    doc = {"advisor_export": EXPORT_VERSION, "workload": {"spec": workload_spec, "args": workload_args},
           "config": config.model_dump(mode="json"), "changes": config.changes()}
    return json.dumps(doc, indent=2, default=str) + "\n"


def torchrun_command(config: TrainingConfig, script: str = "train.py", *, numa_node: int = 0) -> str:
    """`torchrun --standalone --nproc-per-node N script`, with the config's threads and pinning.

    Pinning `node`: one process binds with `numactl` to `numa_node` (the device's local node);
    several CUDA ranks use torchrun's `--numa-binding node`, which binds each rank near its own
    GPU. Pinning `cpus`: `taskset -c LIST`. torchrun sets OMP_NUM_THREADS=1 for several ranks,
    so threads are given explicitly (the cores split between ranks when the config leaves them).
    """
    c = config
    words = []
    if c.threads:
        words.append(f"OMP_NUM_THREADS={c.threads}")
    elif c.nproc > 1 and c.device == "cpu":
        words.append(f"OMP_NUM_THREADS=$(( $(nproc) / {c.nproc} ))")
    per_rank_numa = c.pinning == Pinning.node and c.nproc > 1 and c.device == "cuda"
    if c.pinning == Pinning.node and not per_rank_numa:
        words += ["numactl", f"--cpunodebind={numa_node}", f"--membind={numa_node}"]
    elif c.pinning == Pinning.cpus and c.cpu_list:
        words += ["taskset", "-c", c.cpu_list]
    words += ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(c.nproc)]
    if per_rank_numa:
        words += ["--numa-binding", "node"]
    words.append(shlex.quote(script))
    return " ".join(words) + "\n"


def export(config: TrainingConfig, workload_spec: str, workload_args: dict[str, Any] | None = None,
           fmt: Format | str = "json", *, script: str = "train.py", numa_node: int = 0) -> str:
    """`config` for `workload_spec` (a preset name or file.py:build) as `fmt`: json, python or torchrun.

    The Python script loads the workload (to know whether it brings a Dataset), so a user's
    workload file is imported here, as `advisor tune` did.
    """
    args = dict(workload_args or {})
    if fmt == "json":
        return export_json(config, workload_spec, args)
    if fmt == "torchrun":
        return torchrun_command(config, script, numa_node=numa_node)
    if fmt == "python":
        from advisor.export_python import python_script
        from advisor.workload import load_workload

        workload = load_workload(workload_spec, args)
        return python_script(config, workload_spec, args, has_dataset=workload.dataset is not None)
    raise SpecError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
