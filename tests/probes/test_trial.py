"""Measured trials in real processes on this CPU: each knob observably applied, the figures a
trial reports, and every failure status produced by a workload written to fail that way."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from advisor.trial import TrialBudget, TrialStatus
from probes.runner import run_trial

HERE = Path(__file__).resolve().parent
RECORDER = f"{HERE / 'recorder.py'}:build"
QUICK = TrialBudget(warmup_steps=2, min_steps=3, min_time_s=0.0, timeout_s=120, settle_s=0)


def records(out_dir: Path, fail: str = "none") -> list[dict]:
    path = out_dir / f"log-{fail}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def trial(tmp_path: Path, fail: str = "none", budget: TrialBudget = QUICK, **knobs):
    return run_trial(RECORDER, knobs, hardware="cpu", workload_args={"out_dir": str(tmp_path), "fail": fail},
                     budget=budget, estimate=False)


def test_ok_trial_reports_every_figure():
    # A forked CPU rank's peak is not docs/design.md's fresh-process one (probes/runner.py _record_peak):
    # it must not refine the CPU estimate. And a trial using a sliver of the host's memory makes no
    # fresh-process protocol run under record_peak='auto' (probes/protocol.py): no measured peak added.
    from advisor.estimate.model import EstimateRequest
    from advisor.fingerprint import workload_fingerprint
    from advisor.hardware import get_hardware
    from advisor.peaks import default_peaks, device_key, point_key, request_knobs
    from advisor.workload import load_workload

    knobs = request_knobs(EstimateRequest(batch_size=4), 1, "none", "cpu_rss")
    key = point_key(workload_fingerprint(load_workload("tiny-gpt2")), device_key(get_hardware("cpu")), knobs)
    kept = len(default_peaks().points(key))
    r = run_trial("tiny-gpt2", {"batch_size": 4}, hardware="cpu", budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    assert r.samples_per_s > 0 and r.measured_steps >= 3
    assert r.tokens_per_s == pytest.approx(r.samples_per_s * 32)  # tiny-gpt2: 32 tokens per sample
    assert 0 < r.step_time_s.p50 <= r.step_time_s.p90
    assert 0 <= r.data_wait_fraction < 1
    assert r.peak_memory_bytes == r.peak_memory.cpu_rss_bytes > 0
    assert r.predicted_memory_bytes > 0 and r.predicts == "cpu_rss"
    assert r.mfu is not None and 0 < r.mfu < 1
    assert r.bottleneck.verdict in ("input-bound", "compute-bound", "overhead-bound")
    assert r.bottleneck.ops_per_step > 50  # a transformer step dispatches many ops
    import torch

    assert r.environment.torch == torch.__version__
    assert r.overhead_s is not None and r.wall_s >= r.measured_s
    assert r.protocol_peak_bytes is None
    assert len(default_peaks().points(key)) == kept


def test_a_rank_at_a_raised_niceness_records_it_and_says_its_figures_may_be_low(tmp_path):
    # `advisor trial` under `nice`: its fork server, so every rank, inherits the niceness (as a Ray
    # worker's trials inherit Ray's 15 where a cluster keeps that default)
    import subprocess
    import sys

    nice = os.getpriority(os.PRIO_PROCESS, 0) + 3
    cmd = [sys.executable, "-m", "advisor.cli", "trial", "-w", RECORDER, "-H", "cpu", "-a", f"out_dir={tmp_path}",
           "--set", "batch_size=2", "--warmup-steps", "1", "--min-steps", "2", "--min-time", "0", "--no-estimate",
           "--record-peak", "never", "--settle", "0", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.nice(3),
                          env={**os.environ, "ADVISOR_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["status"] == "ok" and out["environment"]["niceness"] == nice
    assert any(f"ran at niceness {nice}" in n for n in out["notes"]), out["notes"]
    assert out["others_busy"] is None  # --settle 0: started at once, the machine's load not looked at


def test_a_trial_on_a_busy_machine_waits_for_quiet_then_records_how_busy_and_says_its_figures_may_be_low(tmp_path):
    # one busy loop per CPU for the whole trial: the machine never goes quiet within settle_s, so the trial
    # waits that long, then starts, records the share its neighbours took and says how far off it may be.
    # The loops run at niceness 19: busy all the same in /proc/stat, they leave the CPU to the suite's
    # other tests (an estimate timed against a deadline in another worker)
    import subprocess
    import sys

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
             for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        res = trial(tmp_path, budget=QUICK.model_copy(update={"settle_s": 1.5}), batch_size=2)
        waited = time.monotonic() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert res.status == TrialStatus.ok, res.error
    assert res.others_busy is not None and res.others_busy > QUICK.quiet_cpu_fraction, res.others_busy
    assert waited >= 1.5
    busy = [n for n in res.notes if "busy with other work" in n]
    assert busy and f"{res.others_busy:.0%} busy" in busy[0] and "several times low" in busy[0], res.notes
    assert trial(tmp_path, batch_size=2).others_busy is None  # settle_s 0: not looked


def test_cpu_trial_keeps_a_fresh_process_peak_that_refines_the_estimate():
    # record_peak='auto' under a cap the trial's predicted peak is over 1/8 of: after the trial, one run of
    # docs/design.md's protocol in a fresh process, kept as a measured peak that the next estimate of the
    # same configuration goes through; a trial at a batch within 2x of it makes no second run.
    # (sgd-momentum with the foreach step: a configuration no other test's calibration records.)
    from advisor.estimate import EstimateOptions, estimate_memory
    from advisor.estimate.model import EstimateRequest
    from advisor.fingerprint import workload_fingerprint
    from advisor.hardware import get_hardware
    from advisor.peaks import default_peaks, device_key, point_key, request_knobs
    from advisor.workload import load_workload

    wargs = {"num_samples": 256}
    knobs = {"optimizer": "sgd-momentum", "optimizer_impl": "foreach"}

    def estimate(batch: int, **options):
        return estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=batch, **knobs),
                               EstimateOptions(calibrate=False, **options), workload_args=wargs)

    key = point_key(workload_fingerprint(load_workload("tiny-gpt2", wargs)), device_key(get_hardware("cpu")),
                    request_knobs(EstimateRequest(batch_size=64, optimizer="sgd-momentum", optimizer_impl="foreach"),
                                  1, "none", "cpu_rss"))
    assert default_peaks().points(key) == []
    budget = QUICK.model_copy(update={"memory_cap_bytes": 768 * 2**20})
    first = run_trial("tiny-gpt2", {"batch_size": 64, **knobs}, hardware="cpu", workload_args=wargs, budget=budget)
    assert first.status == TrialStatus.ok, first.error
    assert first.predicted_memory_bytes >= budget.memory_cap_bytes / 8  # so 'auto' runs the protocol
    assert first.protocol_peak_bytes > 0 and any("fresh process" in n for n in first.notes)
    [point] = default_peaks().points(key)
    assert (point.batch_size, point.peak_bytes, point.predicted_bytes) == (64, first.protocol_peak_bytes,
                                                                           first.predicted_memory_bytes)
    refined = estimate(64)
    assert any("refined by 1 measured peak" in n for n in refined.notes)
    assert refined.total_bytes == pytest.approx(first.protocol_peak_bytes, rel=0.01)

    second = run_trial("tiny-gpt2", {"batch_size": 96, **knobs}, hardware="cpu", workload_args=wargs, budget=budget)
    assert second.status == TrialStatus.ok, second.error
    assert second.protocol_peak_bytes is None and len(default_peaks().points(key)) == 1
    unrefined = estimate(96, measured=False)
    assert second.predicted_memory_bytes == estimate(96).total_bytes \
        != unrefined.total_bytes


def test_workers_are_processes_and_grad_accum_takes_micro_batches(tmp_path):
    r = trial(tmp_path, batch_size=4, num_workers=2, grad_accum=2, prefetch_factor=2)
    assert r.status == TrialStatus.ok, r.error
    recs = records(tmp_path)
    main_pids = {rec["pid"] for rec in recs}
    sample_pids = {p for rec in recs for p in rec["sample_pids"]}
    assert len(main_pids) == 1
    assert len(sample_pids) == 2 and not sample_pids & main_pids  # two worker processes made the samples
    assert len(recs) == (QUICK.warmup_steps + r.measured_steps) * 2  # two micro-batches per optimizer step


def test_no_workers_loads_in_the_main_process(tmp_path):
    r = trial(tmp_path, batch_size=4)
    assert r.status == TrialStatus.ok, r.error
    recs = records(tmp_path)
    assert {p for rec in recs for p in rec["sample_pids"]} == {recs[0]["pid"]}


def test_bf16_autocast_channels_last_and_threads_apply(tmp_path):
    r = trial(tmp_path, batch_size=4, precision="bf16", channels_last=True, threads=1)
    assert r.status == TrialStatus.ok, r.error
    rec = records(tmp_path)[-1]
    assert rec["out_dtype"] == "torch.bfloat16"
    assert rec["channels_last"] is True
    assert rec["threads"] == 1


def test_pinning_sets_the_affinity_of_the_rank_and_its_workers(tmp_path):
    r = trial(tmp_path, batch_size=4, num_workers=1, pinning="cpus", cpu_list="0")
    assert r.status == TrialStatus.ok, r.error
    recs = records(tmp_path)
    assert {tuple(rec["affinity"]) for rec in recs} == {(0,)}  # the training process
    assert {tuple(c) for rec in recs for c in rec["sample_cpus"]} == {(0,)}  # its DataLoader worker
    assert recs[-1]["threads"] == 1  # no more intra-op threads than pinned CPUs
    assert r.environment.cpu_count == 1
    assert os.sched_getaffinity(0) != {0}  # the test process itself was left alone


def test_node_pinning_uses_the_node_cpulist(tmp_path):
    from advisor.hardware.sysinfo import parse_cpulist

    node0 = Path("/sys/devices/system/node/node0/cpulist")
    if not node0.exists():
        pytest.skip("no NUMA node in sysfs on this machine")
    r = trial(tmp_path, batch_size=4, num_workers=2, pinning="node")
    assert r.status == TrialStatus.ok, r.error
    want = tuple(sorted(set(parse_cpulist(node0.read_text())) & os.sched_getaffinity(0)))
    recs = records(tmp_path)
    assert {tuple(rec["affinity"]) for rec in recs} == {want}
    assert {tuple(c) for rec in recs for c in rec["sample_cpus"]} == {want}


def test_fp32_default_is_fp32_and_contiguous(tmp_path):
    r = trial(tmp_path, batch_size=4)
    assert r.status == TrialStatus.ok, r.error
    rec = records(tmp_path)[-1]
    assert rec["out_dtype"] == "torch.float32" and rec["channels_last"] is False


@pytest.mark.parametrize("knobs", [{"optimizer_impl": "foreach"}, {"optimizer_impl": "fused"},
                                   {"fused_backward": True}, {"checkpointing": True, "optimizer": "sgd-momentum"},
                                   {"precision": "bf16-pure"}])
def test_step_variants_run(knobs):
    r = run_trial("tiny-mlp", {"batch_size": 16, **knobs}, hardware="cpu", budget=QUICK, estimate=False)
    assert r.status == TrialStatus.ok, r.error


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_data_parallel_trial_runs_two_gloo_ranks_that_agree(strategy):
    r = run_trial("tiny-mlp", {"batch_size": 8, "strategy": strategy, "nproc": 2}, hardware="cpu", budget=QUICK,
                  estimate=False)
    assert r.status == TrialStatus.ok, r.error
    assert r.hardware == "cpu:2"
    assert len(r.rank_digests) == 2 and r.rank_digests[0] == r.rank_digests[1]  # parameters agree after the steps
    single = run_trial("tiny-mlp", {"batch_size": 8}, hardware="cpu", budget=QUICK, estimate=False)
    assert single.rank_digests == []  # digests are taken where ranks must agree


@pytest.mark.parametrize("strategy, nproc", [("single", 1), ("ddp", 2), ("zero3", 2)])
def test_selective_checkpointing_trains_a_decoder_and_is_recorded(strategy, nproc):
    r = run_trial("tiny-gpt2", {"batch_size": 2, "strategy": strategy, "nproc": nproc, "checkpointing": "selective"},
                  hardware="cpu", budget=QUICK, estimate=nproc == 1)
    assert r.status == TrialStatus.ok, r.error
    assert r.config.checkpointing.value == "selective"
    assert nproc == 1 and r.predicted_memory_bytes or r.rank_digests[0] == r.rank_digests[1]


def test_a_strategy_that_cannot_run_is_invalid():
    r = run_trial("tiny-mlp", {"strategy": "zero2", "nproc": 2, "optimizer": "sgd", "optimizer_impl": "fused"},
                  hardware="cpu", estimate=False)
    assert r.status == TrialStatus.invalid and "fused" in r.error


def test_compile_invokes_inductor():
    r = run_trial("tiny-mlp", {"batch_size": 16, "compile_mode": "default"}, hardware="cpu", budget=QUICK,
                  estimate=False)
    assert r.status == TrialStatus.ok, r.error
    assert r.compiled_graphs is not None and r.compiled_graphs >= 1  # dynamo captured the model, inductor built it
    assert r.compile_s is not None and r.compile_s >= 0
    assert r.bottleneck.ops_per_step is None  # ops are counted in eager runs only
    eager = run_trial("tiny-mlp", {"batch_size": 16}, hardware="cpu", budget=QUICK, estimate=False)
    assert eager.compiled_graphs is None and eager.compile_s is None


@pytest.mark.parametrize("knobs, reason", [
    ({"precision": "fp16"}, "CUDA"), ({"compile_mode": "reduce-overhead"}, "CUDA graphs"),
    ({"pin_memory": True}, "CUDA"), ({"channels_last": True}, "convolutional"),
])
def test_knobs_that_cannot_apply_are_invalid_without_launching(knobs, reason):
    t0 = time.monotonic()
    r = run_trial("tiny-mlp", knobs, hardware="cpu", estimate=False)
    assert r.status == TrialStatus.invalid and reason in r.error
    assert time.monotonic() - t0 < 2.0  # nothing was started


def test_exception_in_workload_is_error_with_traceback(tmp_path):
    r = trial(tmp_path, fail="raise")
    assert r.status == TrialStatus.error
    assert r.error.startswith("ValueError: the workload failed on purpose")
    assert "recorder.py" in r.error  # the traceback's tail names where


@pytest.mark.parametrize("fail, signal_name", [("abort", "SIGABRT"), ("segv", "SIGSEGV")])
def test_signal_is_crashed_and_named(tmp_path, fail, signal_name):
    r = trial(tmp_path, fail=fail)
    assert r.status == TrialStatus.crashed
    assert signal_name in r.error


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has no memory or CPU left
    except FileNotFoundError:
        return True


def test_hang_times_out_and_leaves_no_process(tmp_path):
    budget = TrialBudget(warmup_steps=2, min_steps=3, min_time_s=0.0, timeout_s=12)
    r = trial(tmp_path, fail="hang", budget=budget, batch_size=4, num_workers=2, persistent_workers=True)
    assert r.status == TrialStatus.timeout and "killed" in r.error
    assert r.wall_s < 30
    recs = records(tmp_path, "hang")
    pids = {recs[0]["pid"], *recs[0]["children"]}  # the rank and its two DataLoader workers
    assert len(pids) == 3
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


def test_memory_past_the_cap_is_oom(tmp_path):
    budget = TrialBudget(warmup_steps=2, min_steps=3, min_time_s=0.0, timeout_s=60, memory_cap_bytes=1 << 30)
    r = trial(tmp_path, fail="alloc", budget=budget)
    assert r.status == TrialStatus.oom and "memory cap" in r.error


def test_bad_input_raises_before_launching():
    from advisor.errors import SpecError

    with pytest.raises(SpecError, match="valid presets"):
        run_trial("no-such-preset", {}, hardware="cpu")
    with pytest.raises(SpecError, match="known: device, batch_size"):
        run_trial("tiny-mlp", {"batch": 3}, hardware="cpu")
    with pytest.raises(SpecError, match="num_workers"):
        run_trial("tiny-mlp", {"persistent_workers": True}, hardware="cpu")


def test_a_trial_records_the_estimate_its_launch_rested_on_and_makes_none_of_its_own(tmp_path, monkeypatch):
    # The tuner launches a configuration on an estimate (search_spaces.feasibility) and hands it to the trial. A
    # workload file's estimate is never reused (the file may change), so the trial would load and trace it again.
    from advisor import isolation
    from advisor.hardware import get_hardware
    from advisor.trial import TrainingConfig
    from search_spaces import feasibility

    hw, wargs = get_hardware("cpu"), {"out_dir": str(tmp_path)}
    feas = feasibility(RECORDER, wargs, hw, TrainingConfig(batch_size=4), None)
    assert feas.launch and feas.estimate.total_bytes == feas.total_bytes and "estimate" not in feas.model_dump()
    made: list[tuple] = []
    estimate = isolation.estimate
    monkeypatch.setattr(isolation, "estimate", lambda *a, **k: made.append(a) or estimate(*a, **k))
    given = run_trial(RECORDER, {"batch_size": 4}, hardware=hw, workload_args=wargs, budget=QUICK,
                      prediction=feas.estimate)
    assert given.status == TrialStatus.ok and given.predicted_memory_bytes == feas.total_bytes and made == []
    alone = run_trial(RECORDER, {"batch_size": 4}, hardware=hw, workload_args=wargs, budget=QUICK)
    assert alone.status == TrialStatus.ok and len(made) == 1 and alone.predicted_memory_bytes > 0
