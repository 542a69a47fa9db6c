"""Measured trials on a CUDA GPU: the CUDA memory peaks of docs/design.md, precisions and compile modes
that only apply there, pinned host memory. Needs a GPU; skipped without one."""

from __future__ import annotations

import pytest

from advisor.trial import TrialBudget, TrialStatus
from probes.runner import run_trial

pytestmark = pytest.mark.gpu
QUICK = TrialBudget(warmup_steps=2, min_steps=3, min_time_s=0.0, timeout_s=300, settle_s=0)


@pytest.fixture(scope="module", autouse=True)
def _need_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine: CUDA trials are checked only where one exists")


def test_cuda_trial_reports_allocated_and_reserved_peaks():
    r = run_trial("tiny-gpt2", {"batch_size": 8, "precision": "bf16", "pin_memory": True, "num_workers": 1},
                  hardware="local", budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    peak = r.peak_memory
    assert 0 < peak.cuda_allocated_bytes <= peak.cuda_reserved_bytes == r.peak_memory_bytes
    assert r.environment.cuda and r.environment.device_name != r.environment.cpu_model
    assert r.predicts == "cuda_reserved" and r.predicted_memory_bytes > 0


@pytest.mark.parametrize("knobs", [{"precision": "fp16"}, {"precision": "tf32"},
                                   {"compile_mode": "reduce-overhead"}, {"optimizer_impl": "fused"}])
def test_cuda_only_knobs_run(knobs):
    r = run_trial("tiny-mlp", {"batch_size": 32, **knobs}, hardware="local", budget=QUICK, estimate=False)
    assert r.status == TrialStatus.ok, r.error


def test_cuda_oom_is_a_status():
    # attention scores alone: 4096 x 4 heads x 8192^2 fp32 = 4.4 TB
    r = run_trial("tiny-gpt2", {"batch_size": 4096}, hardware="local", budget=QUICK, estimate=False,
                  workload_args={"seq_len": 8192, "num_samples": 4096})
    assert r.status == TrialStatus.oom
