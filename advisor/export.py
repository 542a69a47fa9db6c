"""Export of a chosen configuration (`advisor results export`): JSON (config + workload), a Python
training script, or the launch command (torchrun, under numactl or taskset when pinned)."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any, Literal

from advisor.errors import SpecError
from advisor.trial import Pinning, TrainingConfig

if TYPE_CHECKING:
    from advisor.store import ResultStore, TrialRecord

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
    workload file is imported here, as `advisor tune` did. The script and its launch command run
    data parallel only: SpecError for a config with tp or pp > 1 (its JSON holds every knob).
    """
    from advisor.export_python import check_data_parallel
    from advisor.finetune import with_rank

    args = with_rank(workload_args, config.lora_r)  # the rank the trial's adapters had
    if fmt == "json":
        return export_json(config, workload_spec, args)
    if fmt in ("python", "torchrun"):
        check_data_parallel(config)
    if fmt == "torchrun":
        return torchrun_command(config, script, numa_node=numa_node)
    if fmt == "python":
        from advisor import isolation
        from advisor.export_python import python_script

        info = isolation.describe(workload_spec, args)
        return python_script(config, workload_spec, args, has_dataset=info.has_dataset)
    raise SpecError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")


def stored_choice(store: "ResultStore", *, trial_id: int | None = None, workload: str | None = None,
                  hardware: str | None = None) -> "TrialRecord":
    """The trial to export: `trial_id`, or the stored best (a throughput objective's, where several
    objectives are stored) for the workload and hardware (names or fingerprints). SpecError when
    there is none, when the trial did not finish ok, or when several workload/hardware pairs match."""
    if trial_id is not None:
        trial = store.get_trial(trial_id)
        if trial is None:
            raise SpecError(f"no trial with id {trial_id} in the store; `advisor results list` shows the ids")
        if trial.status.value != "ok":
            raise SpecError(f"trial {trial_id} is {trial.status.value}, not ok; export a measured configuration")
        return trial
    if not (workload or hardware):
        raise SpecError("name a trial (--trial ID) or the best to export (--workload W and/or --hardware H)")
    bests = store.best(workload=workload, hardware=hardware)
    asked = " and ".join(f"{k} {v!r}" for k, v in (("workload", workload), ("hardware", hardware)) if v)
    if not bests:
        raise SpecError(f"no best configuration stored for {asked}; `advisor results best` lists them")
    pairs = {(b.workload_fp, b.hardware_fp) for b in bests}
    if len(pairs) > 1:
        ids = ", ".join(str(b.trial.id) for b in bests)
        raise SpecError(f"{len(pairs)} workload/hardware pairs have a best for {asked} (trials {ids}); "
                        f"narrow --workload/--hardware to a fingerprint or give --trial ID")
    throughput = [b for b in bests if b.objective.split(":", 1)[0] in ("samples_per_s", "tokens_per_s")]
    return (throughput or bests)[0].trial


def export_stored(store: "ResultStore", fmt: Format | str = "json", *, trial_id: int | None = None,
                  workload: str | None = None, hardware: str | None = None, script: str = "train.py") -> str:
    """Export a stored trial (or the stored best) as `fmt`, for the workload its study describes
    ({"spec": ..., "args": ...} as the tuner stores it; else the workload's name and no arguments)."""
    if fmt not in FORMATS:
        raise SpecError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    trial = stored_choice(store, trial_id=trial_id, workload=workload, hardware=hardware)
    desc = store.workload_description(trial.workload_fp) or {}
    spec = desc.get("spec") if isinstance(desc.get("spec"), str) else trial.workload_name
    args = desc.get("args") if isinstance(desc.get("args"), dict) else {}
    return export(trial.config, spec, args, fmt, script=script)
