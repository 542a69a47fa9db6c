"""Real values to store: a study spec on the catalog's CPU, TrialConfigs and TrialResults as the
runner reports them."""

from __future__ import annotations

from advisor.hardware import get_hardware
from advisor.store import Objective, StudySpec, hardware_fingerprint, software_versions
from advisor.trial import Bottleneck, PeakMemory, StepTimes, TrainingConfig, TrialResult, TrialStatus

THROUGHPUT = Objective.parse("samples_per_s:maximize")
WORKLOADS = {"tiny-gpt2": "a1" * 32, "resnet-tiny": "b2" * 32}


def spec(name: str = "study-a", workload: str = "tiny-gpt2", hardware: str = "cpu", objective: Objective = THROUGHPUT,
         software: dict | None = None) -> StudySpec:
    hw = get_hardware(hardware)
    return StudySpec(name=name, workload_fp=WORKLOADS[workload], workload_name=workload,
                     workload_description={"params": 1234}, hardware_fp=hardware_fingerprint(hw),
                     hardware_name=hardware, hardware_spec=hw.model_dump(mode="json"), space={"batch_size": [2, 4, 8]},
                     objective=objective, software=software or software_versions())


def config(batch_size: int = 4, **knobs) -> TrainingConfig:
    return TrainingConfig(batch_size=batch_size, **knobs)


def result(cfg: TrainingConfig, status: TrialStatus = TrialStatus.ok, samples_per_s: float | None = 120.0,
           peak: int | None = 300 << 20, workload: str = "tiny-gpt2") -> TrialResult:
    """A trial result with every figure the runner fills in on an ok CPU run."""
    if status != TrialStatus.ok:
        return TrialResult(status=status, workload=workload, hardware="cpu", config=cfg,
                           error=f"{status.value}: as the runner would say", wall_s=3.0)
    return TrialResult(status=status, workload=workload, hardware="cpu", config=cfg, samples_per_s=samples_per_s,
                       tokens_per_s=samples_per_s * 32, step_time_s=StepTimes(p50=cfg.batch_size / samples_per_s,
                       p90=1.2 * cfg.batch_size / samples_per_s, mean=1.1 * cfg.batch_size / samples_per_s),
                       data_wait_fraction=0.02, peak_memory_bytes=peak, peak_memory=PeakMemory(cpu_rss_bytes=peak),
                       predicted_memory_bytes=int(peak * 1.1), predicts="cpu_rss", mfu=0.08, measured_steps=10,
                       bottleneck=Bottleneck(verdict="compute-bound", reason="matmuls dominate",
                                             data_wait_fraction=0.02),
                       wall_s=5.0, measured_s=2.0, warmup_s=1.0)
