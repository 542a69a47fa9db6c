"""A store with real measured trials for the API tests: tiny-mlp on this CPU, measured once per test
run by `probes.run_trial` (real training steps in fresh processes), then written into any store
the way the tuner writes them (claim, finish, update best)."""

from __future__ import annotations

import functools

from advisor.fingerprint import workload_fingerprint
from advisor.hardware import get_hardware
from advisor.store import Objective, StudySpec, hardware_fingerprint, open_store, software_versions
from advisor.trial import TrainingConfig, TrialBudget, TrialResult
from advisor.workload import load_workload

WORKLOAD, HARDWARE = "tiny-mlp", "cpu"
THROUGHPUT = Objective.parse("samples_per_s:maximize")
# Two batch sizes x two precisions: the page's throughput-vs-batch plot gets a line per precision.
CONFIGS = [{"batch_size": b, "precision": p} for p in ("fp32", "bf16") for b in (4, 32)]
BUDGET = TrialBudget(warmup_steps=1, min_steps=3, min_time_s=0.3, timeout_s=120, settle_s=0)


@functools.lru_cache(maxsize=1)
def measured() -> tuple[TrialResult, ...]:
    from probes.runner import run_trial

    results = tuple(run_trial(WORKLOAD, dict(c, device="cpu"), hardware=HARDWARE, budget=BUDGET, estimate=False)
                    for c in CONFIGS)
    assert all(r.ok and r.samples_per_s for r in results), [r.error for r in results]
    return results


def seed(url: str, study: str = "seeded-tiny-mlp") -> dict:
    """Write the measured trials into the store at `url` as one study; returns its ids and figures."""
    wl = load_workload(WORKLOAD)
    hw = get_hardware(HARDWARE)
    spec = StudySpec(name=study, workload_fp=workload_fingerprint(wl), workload_name=wl.name,
                     workload_description={"spec": WORKLOAD, "args": {}}, hardware_fp=hardware_fingerprint(hw),
                     hardware_name=hw.accelerator.name, hardware_spec=hw.model_dump(mode="json"), objective=THROUGHPUT,
                     software=software_versions())
    ids = []
    with open_store(url) as store:
        s = store.create_or_get_study(spec)
        for result in measured():
            config = TrainingConfig.model_validate(result.config.model_dump())
            rec = store.finish_trial(store.claim_trial(s.id, config), result)
            store.update_best(s.workload_fp, s.hardware_fp, THROUGHPUT, rec.id)
            ids.append(rec.id)
        store.finish_study(s.id)
        best = max(store.study_trials(s.id), key=lambda t: t.samples_per_s or 0)
    return {"study_id": s.id, "trial_ids": ids, "best_trial_id": best.id, "best_samples_per_s": best.samples_per_s,
            "workload_fp": spec.workload_fp, "hardware_fp": spec.hardware_fp}
