"""The planner's search (advisor/plan/search.py) and `advisor plan`: real estimator and step-time model, no mocks.
Large models plan on the analytic path; each test asserts what would fail if the search or the CLI broke."""

from __future__ import annotations

import json

import pytest
from plan_cli import advisor

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.estimate.model import EstimateRequest
from advisor.estimate.parallel import estimate_layout
from advisor.hardware import get_hardware
from advisor.parallel.layout import PipelineSchedule
from advisor.plan.knobs import PlanConfig, parse_fixes
from advisor.plan.memory import _analytic, device_memory, peak_ranks, rank_peak
from advisor.plan.search import PlanRequest, plan
from advisor.plan.steptime import predict_step
from advisor.presets import get_preset

PLAN_KEYS = {"config", "memory_per_device_bytes", "fits", "step_time_s", "tokens_per_s_per_device", "samples_per_s",
             "breakdown"}


def test_llama_8b_on_one_node_fits_with_a_sharded_plan():
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"], top=3))
    assert result.fits and result.plans
    best = result.plans[0]
    assert best.fits and best.memory_per_device_bytes <= best.usable_bytes
    c = best.config
    assert c.world == 8 and c.global_batch == result.global_batch_size == 512  # 2**20 tokens at seq_len 2048
    assert c.strategy in (Strategy.zero1, Strategy.zero2, Strategy.zero3) or c.tp * c.pp > 1
    scores = [p.tokens_per_s_per_device for p in result.plans]
    assert scores == sorted(scores, reverse=True)


def test_llama_70b_on_four_nodes_fits():
    result = plan(PlanRequest(workload="llama-70b", hardware=["h100-sxm:8x4"], top=1))
    assert result.fits and result.plans[0].fits and result.plans[0].devices == 32
    assert result.plans[0].step_time_s > 0 and result.plans[0].breakdown.compute_s > 0


def test_a_fixed_configuration_is_what_the_estimator_and_step_model_say():
    fixes = ["tp=4", "pp=2", "cp=1", "strategy=zero3", "schedule=1f1b", "micro_batch_size=1", "checkpointing=full"]
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8x2"], global_batch_size=64,
                              fixed=parse_fixes(fixes)))
    assert len(result.plans) == 1
    p, c = result.plans[0], result.plans[0].config
    assert (c.dp, c.microbatches, c.grad_accum) == (2, 32, 1)  # 64 samples over dp 2, micro-batches of 1
    hw = get_hardware("h100-sxm:8x2")
    req = EstimateRequest(batch_size=32, precision=Precision.bf16, optimizer=OptimizerKind.adamw,
                          checkpointing=Checkpointing.full, optimizer_impl="fused")
    est = estimate_layout("llama-8b", hw, c.layout(), req, method="analytic")
    assert p.memory_per_device_bytes == est.peak.total_bytes + est.runtime_bytes + est.peak.nccl_bytes
    assert p.memory["nccl"] == est.peak.nccl_bytes > 0  # tp 4's ring, dp 2's, the pipeline's neighbour
    assert p.fits == est.fits
    step = predict_step(get_preset("llama-8b")().decoder, hw, c.layout(), micro_batch_size=1, grad_accum=1,
                        precision=Precision.bf16, checkpointing=Checkpointing.full, optimizer=OptimizerKind.adamw)
    assert p.step_time_s == step.step_time_s and p.breakdown == step.breakdown
    assert p.tokens_per_s_per_device == pytest.approx(64 * 2048 / step.step_time_s / 16)


def _config(pp: int, v: int, m: int, strategy: Strategy = Strategy.zero3) -> PlanConfig:
    return PlanConfig(dp=2, tp=2, pp=pp, cp=1, strategy=strategy,
                      schedule=PipelineSchedule.interleaved_1f1b if v > 1 else PipelineSchedule.one_f_one_b,
                      virtual_stages=v, microbatches=m, micro_batch_size=2, checkpointing=Checkpointing.selective,
                      precision=Precision.bf16, optimizer=OptimizerKind.adamw, sequence_parallel=True)


@pytest.mark.parametrize("pp,v,m", [(2, 1, 16), (4, 1, 40), (2, 4, 14), (2, 16, 32), (4, 2, 64)])
def test_the_peak_past_the_warm_up_extends_as_the_schedule_walk_says(pp, v, m):
    arch = get_preset("llama-8b")().decoder
    config = _config(pp, v, m, Strategy.zero2 if pp == 4 else Strategy.zero3)
    for rank in range(pp):
        assert rank_peak(arch, config, rank, "cuda") == _analytic(arch, config, rank, "cuda")


@pytest.mark.parametrize("pp,v", [(4, 1), (8, 1), (4, 2), (8, 4)])
def test_the_ranks_that_can_hold_the_peak_hold_it(pp, v):
    arch, hw = get_preset("llama-8b")().decoder, get_hardware("h100-sxm:8x4")
    config = _config(pp, v, 2 * pp)
    assert device_memory(arch, hw, config, 0, peak_ranks(config.layout())) == device_memory(arch, hw, config, 0)


def test_nothing_fits_says_what_would():
    result = plan(PlanRequest(workload="llama-70b", hardware=["h100-sxm:1"], top=2))
    assert not result.fits and result.plans and not any(p.fits for p in result.plans)
    assert result.plans[0].memory_per_device_bytes <= result.plans[1].memory_per_device_bytes  # the closest first
    line = result.what_would_fit[0]
    assert line.startswith("16 devices fit (h100-sxm:8x2)")
    # the configuration it names fits there
    fixed = plan(PlanRequest(workload="llama-70b", hardware=["h100-sxm:8x2"], top=1))
    assert fixed.fits


def test_a_held_knob_in_the_way_is_named():
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"],
                              fixed=parse_fixes(["tp=1", "pp=1", "cp=1", "strategy=ddp"])))
    assert not result.fits
    assert any(line.startswith("without holding strategy=ddp, it fits") for line in result.what_would_fit)


def test_node_ranges_rank_every_count_together():
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"], nodes=(1, 2), top=10))
    assert {p.hardware for p in result.plans} <= {"h100-sxm:8x1", "h100-sxm:8x2"} and result.fits
    per_device = [float(f"{p.tokens_per_s_per_device:.4g}") for p in result.plans]  # ties to 4 figures
    assert per_device == sorted(per_device, reverse=True)


def test_a_price_ranks_by_cost():
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"], prices={"h100-sxm": 3.0}, top=3))
    costs = [p.cost_per_million_tokens for p in result.plans]
    assert result.objective.value == "cost_per_million_tokens" and costs == sorted(costs)
    p = result.plans[0]
    assert costs[0] == pytest.approx(3.0 * 8 * p.step_time_s / 3600 / (512 * 2048) * 1e6)



@pytest.mark.parametrize("args,says", [
    (["--fix", "speed=3"], "--fix speed: unknown knob; knobs: dp, tp"),
    (["--fix", "tp=1", "--fix", "pp=1", "--fix", "cp=1", "--global-batch-size", "100"],
     "global batch 100 does not split over dp 8"),
    (["--nodes", "5-2"], "--nodes '5-2' has no node count"),
    (["--fix", "tp=3"], "tp 3 does not divide"),
    (["--fix", "strategy=zero9"], "--fix strategy:"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    proc = advisor("plan", "-w", "llama-8b", "-H", "h100-sxm:8", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_json_gives_the_plans():
    proc = advisor("plan", "-w", "llama-8b", "-H", "h100-sxm:8", "--top", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["plans"]) == 2 and doc["fits"] is True
    for p in doc["plans"]:
        assert PLAN_KEYS <= set(p)
        assert {"compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "comm_s"} <= set(p["breakdown"])
        assert {"dp", "tp", "pp", "cp", "strategy", "micro_batch_size", "grad_accum", "checkpointing",
                "precision", "offload"} <= set(p["config"])
