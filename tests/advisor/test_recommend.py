"""`recommend` against a real SQLite store holding real TrialResults: measured when the fingerprint
matches, transferred (batch rescaled, precision switched, knobs dropped, throughput scaled by the
roofline) when only other hardware or a same-named workload has results, estimated from an empty
store (with activation checkpointing where nothing fits without it), planned for a decoder on GPUs;
candidates ranked by time and by cost per epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
from stored_bests import GPT_ARGS, store_best

from advisor.errors import SpecError
from advisor.hardware import get_hardware
from advisor.recommend import PER_SAMPLES, recommend
from advisor.settings import get_settings
from advisor.trial import CompileMode, TrainingConfig, inapplicable

A100_BEST = TrainingConfig(device="cuda", batch_size=4096, precision="bf16", num_workers=2)


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No measured peaks or default store of the machine's user leak into the estimates."""
    monkeypatch.setenv("ADVISOR_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'advisor.db'}"


def test_measured_when_the_fingerprints_match(url):
    rec = store_best(url, "a100-80gb", A100_BEST, 50_000.0)
    (r,) = recommend("tiny-gpt2", "a100-80gb", workload_args=GPT_ARGS, db=url)
    assert (r.provenance, r.config, r.source_trial_id) == ("measured", A100_BEST, rec.id)
    assert r.samples_per_s == 50_000.0 and r.tokens_per_s == 50_000.0 * 32
    assert r.peak_memory_bytes == 3 << 30 and r.fits
    assert (r.epoch_basis, r.epoch_samples) == ("dataset", 100_000)
    assert r.time_per_epoch_s == pytest.approx(100_000 / 50_000.0)
    # another workload (tiny-mlp) has nothing stored: not measured from tiny-gpt2's best
    (other,) = recommend("tiny-mlp", "a100-80gb", db=url)
    assert other.provenance == "estimated" and other.source_trial_id is None


def test_transferred_to_a_smaller_gpu_rescales_the_batch_to_fit(url):
    rec = store_best(url, "a100-80gb", A100_BEST, 50_000.0)
    (r,) = recommend("tiny-gpt2", "tiny", workload_args=GPT_ARGS, db=url)
    tiny = get_hardware("tiny")
    assert r.provenance == "transferred" and r.source_trial_id == rec.id and r.source_hardware == "a100-80gb"
    assert 1 <= r.config.batch_size < A100_BEST.batch_size  # 4096 does not fit in 1 GiB
    assert r.fits and r.peak_memory_bytes < tiny.accelerator.memory_bytes
    assert r.config.precision.value == "bf16" and r.config.num_workers == 2  # applicable knobs kept
    assert 0 < r.samples_per_s < 50_000.0  # a 1 TFLOP/s device is slower than an A100 by the roofline
    assert f"batch 4096 -> {r.config.batch_size}" in r.reason
    # the same best transferred to the A100's bigger sibling keeps its batch
    (big,) = recommend("tiny-gpt2", "h100-sxm", workload_args=GPT_ARGS, db=url)
    assert big.provenance == "transferred" and big.config.batch_size == 4096 and big.samples_per_s > 50_000.0


def test_transferred_switches_precision_for_a_v100(url):
    store_best(url, "a100-80gb", A100_BEST, 50_000.0)
    (r,) = recommend("tiny-gpt2", "v100", workload_args=GPT_ARGS, db=url)
    assert r.provenance == "transferred" and r.config.precision.value == "fp16"
    assert r.config.batch_size == 4096 and "bf16 -> fp16" in r.reason
    assert inapplicable(r.config, get_hardware("v100")) is None


def test_transferred_to_a_cpu_switches_fp16_to_bf16_and_drops_cuda_knobs(url):
    v100_best = TrainingConfig(device="cuda", batch_size=256, precision="fp16", pin_memory=True, num_workers=4,
                               compile_mode="reduce-overhead")
    store_best(url, "v100", v100_best, 20_000.0)
    (r,) = recommend("tiny-gpt2", "cpu:1", workload_args=GPT_ARGS, db=url)
    c = r.config
    assert r.provenance == "transferred"
    assert (c.device, c.precision.value, c.pin_memory, c.compile_mode) == ("cpu", "bf16", False, CompileMode.default)
    assert c.num_workers == 4 and c.batch_size == 256
    assert inapplicable(c, get_hardware("cpu:1")) is None
    assert r.samples_per_s < 20_000.0


def test_transferred_from_a_same_named_workload_on_this_hardware(url):
    rec = store_best(url, "a100-80gb", A100_BEST, 50_000.0, args={"seq_len": 16, **GPT_ARGS})
    (r,) = recommend("tiny-gpt2", "a100-80gb", workload_args=GPT_ARGS, db=url)
    assert r.provenance == "transferred" and r.source_trial_id == rec.id
    assert "of the same name" in r.reason and "this hardware" in r.reason
    # 32 tokens per sample instead of 16: more work per sample, fewer samples/s
    assert r.samples_per_s < 50_000.0


def test_estimated_from_an_empty_store(url):
    recs = {r.hardware: r for r in recommend("tiny-gpt2", ["a100-80gb", "v100", "cpu:1"], workload_args=GPT_ARGS,
                                             db=url)}
    assert {r.provenance for r in recs.values()} == {"estimated"}
    assert {h: r.config.precision.value for h, r in recs.items()} == {"a100-80gb": "bf16", "v100": "fp16",
                                                                       "cpu:1": "fp32"}  # catalog CPU: bf16 no faster
    for h, r in recs.items():
        assert r.fits and r.config.batch_size > 8 and r.source_trial_id is None  # above the workload's own batch
        assert r.peak_memory_bytes <= get_hardware(h).memory_per_device_bytes
        assert r.time_per_epoch_s == pytest.approx(100_000 / r.samples_per_s)
    # the largest batch on an 80 GB device is larger than on a 32 GB one
    assert recs["a100-80gb"].config.batch_size > recs["v100"].config.batch_size


def test_an_encoder_that_fits_no_batch_on_one_gpu_is_recommended_with_activation_checkpointing(url):
    """bert-base at 32k tokens on an L4 (24 GB): no batch fits with every activation held; with each layer
    recomputed in backward, batch 1 does."""
    (rec,) = recommend("bert-base", "l4", workload_args={"seq_len": 32768}, db=url)
    assert rec.provenance == "estimated" and rec.fits and rec.config.batch_size >= 1
    assert rec.config.checkpointing.value == "full" and "activation checkpointing (full)" in rec.reason
    assert rec.peak_memory_bytes <= get_hardware("l4").memory_per_device_bytes
    (short,) = recommend("bert-base", "l4", workload_args={"seq_len": 512}, db=url)
    assert short.fits and short.config.checkpointing.value == "none"  # it fits as it is: nothing recomputed


def test_epoch_is_the_dataset_or_a_million_samples(url):
    (small,) = recommend("tiny-gpt2", "a100-80gb", db=url)  # default dataset: 64 samples
    assert (small.epoch_basis, small.epoch_samples) == ("dataset", 64)
    assert small.config.batch_size == 64  # the batch never exceeds the dataset
    (r,) = recommend("tests/advisor/no_dataset.py:build", "a100-80gb", db=url)
    assert (r.epoch_basis, r.epoch_samples) == ("per_1e6_samples", PER_SAMPLES)
    assert r.time_per_epoch_s == pytest.approx(PER_SAMPLES / r.samples_per_s)


def test_ranked_by_time_then_by_cost(url):
    store_best(url, "a100-80gb", A100_BEST, 50_000.0)
    hardware = ["tiny", "cpu:1", "a100-80gb", "v100"]
    by_time = recommend("tiny-gpt2", hardware, workload_args=GPT_ARGS, db=url)
    times = [r.time_per_epoch_s for r in by_time]
    assert times == sorted(times) and by_time[0].hardware == "a100-80gb" and len(by_time) == 4
    prices = {"a100-80gb": 1000.0, "tiny": 0.001, "v100": 2.0}
    by_cost = recommend("tiny-gpt2", hardware, workload_args=GPT_ARGS, db=url, prices=prices)
    assert [r.hardware for r in by_cost][-1] == "cpu:1"  # no price: after every priced candidate
    costs = [r.cost_per_epoch for r in by_cost[:3]]
    assert costs == sorted(costs) and by_cost[0].hardware != "a100-80gb"
    for r in by_cost[:3]:
        assert r.cost_per_epoch == pytest.approx(r.time_per_epoch_s / 3600 * prices[r.hardware])


def test_bad_input_raises_spec_errors(url):
    with pytest.raises(SpecError, match="unknown hardware"):
        recommend("tiny-gpt2", ["a100-80gb", "a100"], db=url)
    with pytest.raises(SpecError, match="not a candidate"):
        recommend("tiny-gpt2", ["a100-80gb"], db=url, prices={"h100-sxm": 2.0})
    with pytest.raises(SpecError, match="at least one hardware"):
        recommend("tiny-gpt2", [], db=url)


def test_an_8b_decoder_is_planned_sharded_on_8_gpu_nodes_and_says_what_would_fit_on_l4s(url):
    """A decoder on GPUs with nothing stored is planned: sharded where one device cannot hold it. Four L4s cannot
    hold llama-8b's training state (16 bytes a parameter, 32 GB a device); eight can, at tp 8."""
    recs = recommend("llama-8b", ["l4:4", "a100-80gb:8", "h100-sxm:8"], db=url)
    assert [r.hardware for r in recs] == ["h100-sxm:8", "a100-80gb:8", "l4:4"]  # fitting, then by time per epoch
    for r in recs[:2]:
        assert r.provenance == "planned" and r.fits and r.devices == 8 and r.config.nproc == 8
        layout = r.config.layout()
        assert layout.world == 8 and (layout.fsdp_shards > 1 or layout.tp > 1 or layout.pp > 1)
        assert r.peak_memory_bytes <= get_hardware(r.hardware).memory_per_device_bytes
        assert r.time_per_epoch_s == pytest.approx(r.epoch_samples / r.samples_per_s)
        assert "planned: the fastest plan that fits" in r.reason and "s a step" in r.reason
    assert recs[0].samples_per_s > recs[1].samples_per_s
    l4 = recs[2]
    assert l4.provenance == "planned" and not l4.fits and l4.samples_per_s is None
    assert "no plan fits" in l4.reason and "8 devices fit" in l4.reason


def test_a_70b_decoder_is_planned_onto_four_nodes(url):
    (r,) = recommend("llama-70b", "h100-sxm:8x4", db=url)
    assert r.provenance == "planned" and r.fits and r.devices == 32
    assert r.config.layout().world == 32 and r.config.device == "cuda"


def test_a_plan_becomes_the_trial_configuration_of_the_same_layout():
    from advisor.plan.knobs import PlanConfig
    from advisor.plan.recommend import training_config

    config = PlanConfig(dp=2, tp=2, pp=2, cp=1, strategy="zero2", schedule="interleaved-1f1b", virtual_stages=2,
                        microbatches=4, micro_batch_size=2, checkpointing="selective", precision="bf16",
                        optimizer="adamw", sequence_parallel=True)
    trial = training_config(config)
    assert trial.layout() == config.layout()
    assert trial.batch_size == 8 and trial.nproc == 8 and trial.checkpointing.value == "selective"
