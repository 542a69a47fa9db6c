"""`advisor probe --bench` and probes.bench on this machine: real matmuls, copies and DataLoader workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.cli import main
from advisor.workload import load_workload
from probes.bench import bench_loader, worker_counts
from probes.bench_kernels import COPY_BYTES, bench_matmul

ROOT = Path(__file__).resolve().parents[2]
USABLE = len(os.sched_getaffinity(0))


def test_worker_counts_double_up_to_the_cpu_count():
    assert worker_counts(1) == [0, 1]
    assert worker_counts(2) == [0, 1, 2]
    assert worker_counts(6) == [0, 1, 2, 4, 6]
    assert worker_counts(8) == [0, 1, 2, 4, 8]


def test_probe_bench_json_measures_cpu_and_a_worker_curve(capsys):
    rc = main(["probe", "--bench", "--json", "--bench-seconds", "2", "-a", "decode_cost_ms=5"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out)
    assert report["probe"]["cpu"]["usable_cores"] == USABLE
    bench = report["bench"]
    fp32 = [m for m in bench["matmul"] if m["device"] == "cpu" and m["dtype"] == "fp32"]
    assert len(fp32) == 1 and fp32[0]["tflops"] > 0 and fp32[0]["size"] >= 128
    # The derived peak it is compared with, from the spec it is derived from (None: not derivable here).
    cpu = report["probe"]["cpu"]
    if cpu["peak_tflops"] is not None:
        spec = cpu["spec"]
        assert cpu["peak_tflops"]["fp32"] == pytest.approx(
            spec["cores"] * spec["clock_ghz"] * spec["fp32_flop_per_cycle"] / 1e3)
    (copy,) = [c for c in bench["memory"] if c["device"] == "cpu"]
    assert copy["gb_per_s"] > 0 and copy["tensor_bytes"] == COPY_BYTES["cpu"] >= 256 << 20
    assert copy["bytes_counted"] == 2 * copy["tensor_bytes"]
    if not any(m["device"].startswith("cuda") for m in bench["matmul"]):
        assert bench["host_to_device"] == [] and bench["host_to_device_note"] == "no CUDA device"
    curve = bench["loader"]
    assert curve["workload"] == "tiny-resnet" and curve["batch_size"] == 4 and curve["batches"] >= 4
    assert [p["workers"] for p in curve["points"]] == worker_counts(USABLE)
    assert all(4 <= p["batches"] <= curve["batches"] for p in curve["points"])
    assert all(p["samples_per_s"] == pytest.approx(p["batches"] * 4 / p["seconds"]) for p in curve["points"])
    # At most one 5 ms decode at a time in the main process: 0 workers cannot pass 200 samples/s.
    assert 0 < curve["points"][0]["samples_per_s"] < 1000 / 5
    assert bench["seconds"] < 20


@pytest.mark.skipif(USABLE < 2, reason="DataLoader workers can only beat the main process with 2+ CPUs")
def test_two_workers_beat_the_main_process_on_a_decode_heavy_dataset():
    # 20 ms of decode per sample: CPU-bound loading that two workers do in parallel. The machine
    # is shared, and a busy neighbour delays a decode past its 20 ms: up to three attempts, the
    # best counts. With workers ignored or serialised every attempt stays near 1.0x.
    wl = load_workload("tiny-resnet", {"decode_cost_ms": 20, "batch_size": 2})
    ratios = []
    for _ in range(3):
        curve = bench_loader(wl, [0, 2], 1.2)
        zero, two = (p.samples_per_s for p in curve.points)
        ratios.append(two / zero)
        if ratios[-1] >= 1.3:
            break
    assert max(ratios) >= 1.3, ratios


def test_matmul_size_is_chosen_for_the_target_time():
    result = bench_matmul("cpu", "fp32", 1.2)  # target: one run ~0.3 s
    assert 0.08 < result.seconds_per_run < 1.5, result  # without sizing n=128 runs take ~0.1 ms
    assert result.size > 256 and result.size % 64 == 0 and result.runs >= 2
    assert result.tflops == pytest.approx(2 * result.size**3 * result.reps / result.seconds_per_run / 1e12)


def _advisor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args,says", [
    (["--bench", "--bench-workload", "no-such-net"], "unknown preset 'no-such-net'; valid presets: "),
    (["--bench", "-a", "no_such_arg=1"], "accepted arguments: "),
    (["--bench-seconds", "0"], "give a positive, finite number of seconds"),
    (["-a", "decode_cost_ms=5"], "applies to the bench workload only; add --bench"),
])
def test_bad_bench_input_is_one_line_and_exit_2(args, says):
    proc = _advisor("probe", "--json", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert proc.stdout == ""


def test_bench_table_puts_the_derived_peak_beside_cpu_matmuls(capsys):
    """The table `advisor probe --bench` prints: a CPU row's TFLOP/s, the derived peak, and their ratio."""
    from advisor.bench_result import BenchResult, LoaderCurve, LoaderPoint, MatmulBench
    from advisor.render import bench_tables

    mm = [MatmulBench(device="cpu", dtype="bf16", size=2048, reps=1, runs=3, seconds_per_run=0.1, tflops=0.125),
          MatmulBench(device="cpu", dtype="fp16", size=512, reps=1, runs=3, seconds_per_run=0.1, tflops=0.002)]
    curve = LoaderCurve(workload="tiny-resnet", batch_size=4, batches=4,
                        points=[LoaderPoint(workers=0, batches=4, seconds=0.1, samples_per_s=160.0)])
    result = BenchResult(torch_threads=2, usable_cpus=2, matmul=mm, memory=[], host_to_device=[], loader=curve,
                         budget_seconds=1.0, seconds=1.5)
    bench_tables(result, {"fp32": 0.25, "bf16": 0.5})
    rows = {line.split("│")[2].strip(): line for line in capsys.readouterr().out.splitlines() if "│ cpu" in line}
    assert [cell.strip() for cell in rows["bf16"].split("│")[6:9]] == ["0.125", "0.500", "25%"]  # of 0.5 TFLOP/s
    assert rows["fp16"].split("│")[7].strip() == "-"  # no derived fp16 peak: not a CPU training path
