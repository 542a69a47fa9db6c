"""Real stored results for the recommend and export tests: a study per (workload, hardware) as the
tuner creates it, and an ok TrialResult made its best."""

from __future__ import annotations

from typing import Any

from advisor.fingerprint import workload_fingerprint
from advisor.hardware import get_hardware
from advisor.store import Objective, StudySpec, TrialRecord, hardware_fingerprint, open_store, software_versions
from advisor.trial import PeakMemory, StepTimes, TrainingConfig, TrialResult, TrialStatus
from advisor.workload import load_workload

THROUGHPUT = Objective.parse("samples_per_s:maximize")
# tiny-gpt2 with a dataset large enough that it never caps the batch (the fingerprint ignores it)
GPT_ARGS: dict[str, Any] = {"num_samples": 100_000}


def ok_result(config: TrainingConfig, workload: str, hardware: str, samples_per_s: float, peak: int,
              tokens_per_sample: int | None = 32) -> TrialResult:
    step = config.batch_size / samples_per_s
    return TrialResult(status=TrialStatus.ok, workload=workload, hardware=hardware, config=config,
                       samples_per_s=samples_per_s,
                       tokens_per_s=samples_per_s * tokens_per_sample if tokens_per_sample else None,
                       step_time_s=StepTimes(p50=step, p90=1.1 * step, mean=1.05 * step), data_wait_fraction=0.01,
                       peak_memory_bytes=peak, peak_memory=PeakMemory(cuda_reserved_bytes=peak),
                       predicts="cuda_reserved",
                       measured_steps=20, wall_s=30.0, measured_s=5.0, warmup_s=2.0)


def store_best(url: str, hardware: str, config: TrainingConfig, samples_per_s: float, *, workload: str = "tiny-gpt2",
               args: dict[str, Any] | None = None, peak: int = 3 << 30, study: str | None = None,
               description: dict[str, Any] | None = None) -> TrialRecord:
    """Store `config` measured at `samples_per_s` for `workload` on `hardware`, as that pair's best."""
    args = dict(GPT_ARGS if args is None else args)
    wl = load_workload(workload, args)
    hw = get_hardware(hardware)
    spec = StudySpec(name=study or f"{workload}-{hardware}-{len(args)}", workload_fp=workload_fingerprint(wl),
                     workload_name=wl.name, hardware_fp=hardware_fingerprint(hw), hardware_name=hw.accelerator.name,
                     workload_description={"spec": workload, "args": args} if description is None else description,
                     hardware_spec=hw.model_dump(mode="json"), objective=THROUGHPUT, software=software_versions())
    with open_store(url) as store:
        s = store.create_or_get_study(spec)
        rec = store.finish_trial(store.claim_trial(s.id, config),
                                 ok_result(config, wl.name, hardware, samples_per_s, peak, wl.tokens_per_sample))
        assert store.update_best(s.workload_fp, s.hardware_fp, THROUGHPUT, rec.id)
    return rec
