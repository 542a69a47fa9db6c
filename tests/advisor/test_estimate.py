"""The memory estimator against real torch: breakdown invariants, traced peaks vs the profiler's
exact live-tensor peak, calibrated resident set vs real runs, strategies, knobs, analytic path,
largest batch and bad input.

Real measurements (fresh processes, advisor.measure) start together when the module starts, two
at a time, so they run while the in-process estimator tests do; the tests that compare against
them come last.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import pytest
import torch
from torch import nn

from advisor.config import Strategy
from advisor.errors import SpecError
from advisor.estimate import EstimateOptions, EstimateRequest, MemoryEstimate, estimate_memory
from advisor.measure import MeasureRequest, measure
from advisor.training import RowWiseAdagrad

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead")
MB = 1_000_000

# (preset, batch, precision): traced live-tensor peak vs the profiler's exact one, within 3%.
ALLOC_CASES = [("tiny-mlp", 256, "fp32"), ("tiny-gpt2", 16, "fp32"), ("tiny-resnet", 32, "fp32"),
               ("tiny-llama", 16, "bf16"), ("tiny-lstm", 32, "fp32")]
# (preset, batch, workload args): calibrated resident set vs the median of 5 real runs, within 12%.
# mlp at 64 is dominated by parameters and AdamW state; tiny-gpt2 at 256 by activations.
# Five, not three: mlp at 64 draws one of two levels a run (276 or 306 MiB on one Intel Xeon, 300, 301, 313 on
# another host), so a median of three can sit on either while a calibration aims between them: an estimate of
# 338 MiB (its fit's line alone 331) is +12.2% against runs 300, 301, 313.
RSS_CASES = [("mlp", 64, {}), ("tiny-gpt2", 256, {})]
RSS_RUNS = 5
# 16 layers of 512: FSDP's two gathered units are small against the whole model, so ZeRO-3's
# sharding shows in every persistent part (with 2-layer tiny-gpt2 the gathered units are the model).
DEEP_MLP = {"layers": 16, "hidden": 512}


@pytest.fixture(scope="module", autouse=True)
def real_runs(request) -> Iterator[dict[tuple, Future]]:
    """The real measurements the selected tests compare against, started at once in the background."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    alloc_cases = ALLOC_CASES if "test_traced_allocated_matches_real_live_tensor_peak" in selected else []
    rss_cases = RSS_CASES if "test_calibrated_total_matches_real_resident_set" in selected else []
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[tuple, Future] = {}
    for name, batch, precision in alloc_cases:
        req = MeasureRequest(workload=name, batch_size=batch, precision=precision, mode="alloc")
        futures[("alloc", name, batch, precision)] = pool.submit(measure, req)
    for name, batch, args in rss_cases:
        for i in range(RSS_RUNS):
            req = MeasureRequest(workload=name, workload_args=args, batch_size=batch, mode="rss")
            futures[("rss", name, batch, i)] = pool.submit(measure, req)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


# --- breakdown invariants -------------------------------------------------------------------

@pytest.mark.parametrize("hardware, predicts", [("cpu", "cpu_rss"), ("h100-sxm", "cuda_reserved")])
def test_breakdown_sums_to_total_and_names_what_it_predicts(hardware: str, predicts: str) -> None:
    est = estimate_memory("tiny-gpt2", hardware, EstimateRequest(batch_size=8), EstimateOptions(calibrate=False))
    parts = est.breakdown.model_dump()
    assert set(parts) == set(PARTS)
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == est.total_bytes
    assert 0 < est.allocated_bytes <= est.total_bytes
    assert est.predicts == predicts
    assert est.method == "traced"
    assert parts["parameters"] > 0 and parts["optimizer_state"] > 0 and parts["activations"] > 0


# --- strategies ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def strategy_estimates() -> dict[str, MemoryEstimate]:
    """'single' on one A100 80GB, the other strategies on four."""
    out = {"single": estimate_memory("tiny-mlp", "a100-80gb", EstimateRequest(batch_size=64), workload_args=DEEP_MLP)}
    for strategy in ("ddp", "zero1", "zero3"):
        out[strategy] = estimate_memory("tiny-mlp", "a100-80gb:4", EstimateRequest(batch_size=64, strategy=strategy),
                                        workload_args=DEEP_MLP)
    return out


@pytest.fixture(scope="module")
def by_strategy(strategy_estimates) -> dict[str, dict[str, int]]:
    """Breakdown parts (bytes) per strategy."""
    return {k: est.breakdown.model_dump() for k, est in strategy_estimates.items()}


def test_breakdown_sums_to_total_under_every_strategy(strategy_estimates) -> None:
    for strategy, est in strategy_estimates.items():
        assert est.request.strategy.value == strategy
        assert est.world_size == (1 if strategy == "single" else 4)
        assert sum(est.breakdown.model_dump().values()) == est.total_bytes, strategy
        assert 0 < est.allocated_bytes <= est.total_bytes, strategy
        assert est.predicts == "cuda_reserved"
    assert set(strategy_estimates["zero3"].max_batch_by_strategy) == {"single", "ddp", "zero1", "zero2", "zero3"}


def test_zero3_shards_parameters_gradients_and_optimizer_state(by_strategy) -> None:
    single, zero3 = by_strategy["single"], by_strategy["zero3"]
    for part in ("parameters", "gradients", "optimizer_state"):
        assert single[part] > 0, f"single has no {part} at its peak: the comparison would prove nothing"
        assert zero3[part] < single[part] / 2, (part, zero3[part], single[part])
    # Optimizer state is sharded with nothing gathered: a quarter on each of 4 devices.
    assert zero3["optimizer_state"] == pytest.approx(single["optimizer_state"] / 4, rel=0.02)


def test_zero1_shards_only_optimizer_state(by_strategy) -> None:
    single, zero1, ddp = by_strategy["single"], by_strategy["zero1"], by_strategy["ddp"]
    assert zero1["optimizer_state"] == pytest.approx(single["optimizer_state"] / 4, rel=0.02)
    assert zero1["parameters"] == single["parameters"]
    assert zero1["gradients"] == ddp["gradients"]  # zero1 runs under DDP, whose buckets copy every gradient


def test_nccl_buffers_are_counted_outside_the_allocator(strategy_estimates) -> None:
    from advisor.estimate.nccl import data_parallel_bytes
    from advisor.hardware import get_hardware

    single, ddp, zero3 = (strategy_estimates[k] for k in ("single", "ddp", "zero3"))
    hw = get_hardware("a100-80gb:4")
    # DDP's all-reduce connects NCCL's tree beside its ring: twice the buffers of zero3's ring collectives
    assert data_parallel_bytes(hw, Strategy.ddp) == 2 * data_parallel_bytes(hw, Strategy.zero3) > 100 * 2**20
    assert ddp.runtime_bytes - single.runtime_bytes == data_parallel_bytes(hw, Strategy.ddp)
    assert zero3.runtime_bytes - single.runtime_bytes == data_parallel_bytes(hw, Strategy.zero3)


def test_ddp_adds_gradient_buckets(by_strategy) -> None:
    single, ddp = by_strategy["single"], by_strategy["ddp"]
    assert ddp["gradients"] > single["gradients"]
    # Buckets hold a copy of every gradient: about twice the single-device figure.
    assert ddp["gradients"] == pytest.approx(2 * single["gradients"], rel=0.05)
    assert ddp["parameters"] == single["parameters"]
    assert ddp["optimizer_state"] == single["optimizer_state"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_multi_device_strategy_on_one_device_is_rejected(strategy: str) -> None:
    with pytest.raises(SpecError, match="2\\+ devices"):
        estimate_memory("tiny-mlp", "a100-80gb", EstimateRequest(batch_size=8, strategy=strategy),
                        EstimateOptions(calibrate=False))


# --- knobs ----------------------------------------------------------------------------------

def test_activation_checkpointing_lowers_activations() -> None:
    plain = estimate_memory("tiny-gpt2", "h100-sxm", EstimateRequest(batch_size=8))
    ckpt = estimate_memory("tiny-gpt2", "h100-sxm", EstimateRequest(batch_size=8, checkpointing=True))
    assert ckpt.request.checkpointing
    assert ckpt.breakdown.activations < 0.5 * plain.breakdown.activations
    assert ckpt.allocated_bytes < plain.allocated_bytes
    assert ckpt.max_batch_size > plain.max_batch_size


def test_rowwise_adagrad_keeps_one_value_per_row() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 64)
    bias = nn.Parameter(torch.zeros(64))
    before = emb.weight.detach().clone()
    opt = RowWiseAdagrad([emb.weight, bias], lr=0.1)
    ids = torch.tensor([[1, 5, 7], [5, 9, 999]])
    (emb(ids).sum(dim=1) + bias).pow(2).sum().backward()
    opt.step()
    acc = opt.state[emb.weight]["sum"]
    assert acc.shape == (1000,) and acc.dtype == torch.float32
    assert opt.state[bias]["sum"].shape == (64,)  # not 2-D: element-wise accumulator
    touched = torch.tensor([1, 5, 7, 9, 999])
    assert (acc[touched] > 0).all()
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[touched] = False
    assert (acc[untouched] == 0).all()
    assert not torch.equal(emb.weight[touched], before[touched])
    assert torch.equal(emb.weight[untouched], before[untouched])


def test_rowwise_adagrad_estimate_has_much_smaller_optimizer_state() -> None:
    full = estimate_memory("tiny-dlrm", "h100-sxm", EstimateRequest(batch_size=8, optimizer="adagrad"))
    rowwise = estimate_memory("tiny-dlrm", "h100-sxm", EstimateRequest(batch_size=8, optimizer="rowwise-adagrad"))
    # Tables are 10k x 16: row-wise state is 1/16 of theirs; the MLPs keep full state.
    assert rowwise.breakdown.optimizer_state < full.breakdown.optimizer_state / 8
    assert rowwise.allocated_bytes < full.allocated_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_backward_lowers_gradients(optimizer: str) -> None:
    # An MLP peaks in the optimizer step, when every gradient is alive unless the step is fused.
    plain = estimate_memory("tiny-mlp", "h100-sxm", EstimateRequest(batch_size=64, optimizer=optimizer),
                            workload_args=DEEP_MLP)
    fused = estimate_memory("tiny-mlp", "h100-sxm",
                            EstimateRequest(batch_size=64, optimizer=optimizer, fused_backward=True),
                            workload_args=DEEP_MLP)
    assert plain.breakdown.gradients > 0
    assert fused.breakdown.gradients < plain.breakdown.gradients / 4
    assert fused.allocated_bytes < plain.allocated_bytes


# --- largest batch --------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-mlp", "tiny-gpt2"])
def test_max_batch_size_fits_and_one_more_does_not(preset: str) -> None:
    first = estimate_memory(preset, "tiny", EstimateRequest(batch_size=8))
    m = first.max_batch_size
    assert m > 0
    assert first.fits
    at_max = estimate_memory(preset, "tiny", EstimateRequest(batch_size=m))
    over = estimate_memory(preset, "tiny", EstimateRequest(batch_size=m + 1))
    assert at_max.fits, (m, at_max.total_bytes + at_max.runtime_bytes, at_max.usable_bytes)
    assert not over.fits, (m + 1, over.total_bytes + over.runtime_bytes, over.usable_bytes)
    assert at_max.max_batch_size == m


def test_batch_one_estimate_is_fast() -> None:
    """Batch 1 takes other op paths than 2+: the max-batch search must not retrace per query
    (that cost ~20 s of CPU for tiny-gpt2). CPU time, not wall time: the machine may be shared."""
    start = time.process_time()
    est = estimate_memory("tiny-gpt2", "h100-sxm", EstimateRequest(batch_size=1))
    cpu_s = time.process_time() - start
    assert est.max_batch_size > 1
    assert cpu_s < 6.0, f"estimate of tiny-gpt2 at batch 1 used {cpu_s:.1f} s of CPU"


# --- analytic path --------------------------------------------------------------------------

@pytest.mark.parametrize("preset, batch", [("gpt2-small", 2), ("tiny-llama", 8)])
def test_analytic_matches_traced_allocated(preset: str, batch: int) -> None:
    analytic = estimate_memory(preset, "h100-sxm", EstimateRequest(batch_size=batch),
                               EstimateOptions(method="analytic"))
    traced = estimate_memory(preset, "h100-sxm", EstimateRequest(batch_size=batch), EstimateOptions(method="traced"))
    assert (analytic.method, traced.method) == ("analytic", "traced")
    ratio = analytic.allocated_bytes / traced.allocated_bytes
    # Measured here (torch 2.13 CPU): gpt2-small b2 (seq 1024) 1.137, tiny-llama b8 1.014. The
    # formulas peak at the end of forward with full logits; the trace a bit later.
    assert 0.75 <= ratio <= 1.25, ratio


def test_llama_70b_zero3_uses_analytic_path_quickly() -> None:
    t0 = time.process_time()  # CPU time: the machine may be shared
    est = estimate_memory("llama-70b", "h100-sxm:8", EstimateRequest(strategy="zero3"))
    assert time.process_time() - t0 < 10
    assert est.method == "analytic"
    assert est.world_size == 8
    assert est.num_params > 70e9
    assert sum(est.breakdown.model_dump().values()) == est.total_bytes
    # 70.6B fp32 parameters are 282 GB; sharded 8 ways well under that per device.
    assert est.breakdown.parameters < 282e9 / 4


# --- bad input ------------------------------------------------------------------------------

def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(SpecError) as info:
        estimate_memory("gpt5-huge", "cpu", EstimateRequest(batch_size=8), EstimateOptions(calibrate=False))
    msg = str(info.value)
    assert "gpt5-huge" in msg and "gpt2-small" in msg and "tiny-mlp" in msg


def test_unknown_hardware_lists_valid_names() -> None:
    with pytest.raises(SpecError) as info:
        estimate_memory("tiny-mlp", "h900-sxm", EstimateRequest(batch_size=8), EstimateOptions(calibrate=False))
    msg = str(info.value)
    assert "h900-sxm" in msg and "h100-sxm" in msg and "a100-80gb" in msg


@pytest.mark.parametrize("batch", [-1, -64])
def test_negative_batch_is_rejected(batch: int) -> None:
    with pytest.raises(SpecError, match="positive"):
        estimate_memory("tiny-mlp", "cpu", EstimateRequest.of(batch), EstimateOptions(calibrate=False))


def test_zero_batch_is_rejected() -> None:
    with pytest.raises(SpecError, match="positive"):
        estimate_memory("tiny-mlp", "cpu", EstimateRequest.of(0), EstimateOptions(calibrate=False))


# --- against real runs (last: they wait on the background measurements) --------------------

@pytest.mark.parametrize("name, batch, precision", ALLOC_CASES)
def test_traced_allocated_matches_real_live_tensor_peak(real_runs, name: str, batch: int, precision: str) -> None:
    est = estimate_memory(name, "cpu", EstimateRequest(batch_size=batch, precision=precision),
                          EstimateOptions(calibrate=False))
    assert est.method == "traced"
    real = real_runs[("alloc", name, batch, precision)].result().alloc_peak_bytes
    assert real and real > 0
    assert est.allocated_bytes == pytest.approx(real, rel=0.03), (est.allocated_bytes, real)


@pytest.mark.parametrize("name, batch, args", RSS_CASES)
def test_calibrated_total_matches_real_resident_set(real_runs, name: str, batch: int, args: dict) -> None:
    # Every background run first: the calibration's own runs then do not share the CPU with them.
    for future in real_runs.values():
        future.result()
    runs = [real_runs[("rss", name, batch, i)].result().rss_delta_bytes for i in range(RSS_RUNS)]
    median = statistics.median(runs)
    est = estimate_memory(name, "cpu", EstimateRequest(batch_size=batch), EstimateOptions(calibrate=True),
                          workload_args=args)
    assert est.calibrated and est.predicts == "cpu_rss"
    assert est.total_bytes >= 150 * MB
    # Issue 2: within 12% of a real small CPU run. (A calibration's run must not report this test
    # process's own resident set, which ru_maxrss keeps across the exec: fits would come out at
    # 0.5 x transient + 240 MiB and totals 20% over; advisor/procmem.py and test_procmem.py.)
    assert est.total_bytes == pytest.approx(median, rel=0.12), (est.total_bytes, runs, est.notes)
