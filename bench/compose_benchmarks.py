#!/usr/bin/env python
"""Write BENCHMARKS.md from the results the benchmarks leave in bench/results/.

    .venv/bin/python bench/compose_benchmarks.py [--check]

Every figure on the page comes from a results file: the JSON of bench/estimate_accuracy.py's runs, and the
markdown the other benchmarks write beside their JSON. A re-run of a benchmark replaces its results file; this
script then rewrites the page. `--check` exits 1 where BENCHMARKS.md differs from what it would write.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.estimate_accuracy import (  # noqa: E402
    CASE_COLUMNS,
    GOALS,
    MB_COLUMNS,
    SETS,
    SPEED_COLUMNS,
    SUMMARY_COLUMNS,
    _md_table,
    case_row,
    mb_row,
    speed_row,
    summary_rows,
)

RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"
ESTIMATE = ".venv/bin/python bench/estimate_accuracy.py"
FRESH_DIR = "ADVISOR_DATA_DIR=$(mktemp -d)"  # no calibration or measured peak of another run takes part
# CPU models as /proc/cpuinfo names them, and what each is.
CPU_KINDS = {"AMD EPYC (family 25 model 1)": "Zen 3", "AMD EPYC (family 25 model 17)": "Zen 4",
             "AMD EPYC (family 26 model 2)": "Zen 5"}
ANCHOR_NAMES = {"rule24": "24 B/param", "accelerate": "accelerate", "deepspeed": "DeepSpeed",
                "memtracker": "MemTracker"}
# The anchors beside each comparison of ours: against the same measured peak.
ANCHORS = {"ours_vs_rss": ("rule24_vs_rss", "accelerate_vs_rss", "deepspeed_vs_rss", "memtracker_vs_rss"),
           "ours_vs_alloc": ("memtracker_vs_alloc",),
           "ours_vs_reserved": ("rule24_vs_reserved", "accelerate_vs_reserved", "deepspeed_vs_reserved",
                                "memtracker_vs_reserved")}
GRID = (("fp32", "accuracy-fp32"), ("bf16", "accuracy-bf16"))
# Held-out sets: (results file, set); a set's later run of a part of it follows its whole run.
HELD_OUT = (("accuracy-unseen", "unseen"), ("accuracy-fresh", "fresh"), ("accuracy-kinds", "kinds"),
            ("accuracy-kinds-rerun", "kinds"), ("accuracy-fresh2", "fresh2"), ("accuracy-fresh3", "fresh3"),
            ("accuracy-fresh3-bf16", "fresh3"), ("accuracy-fresh4", "fresh4"), ("accuracy-fresh4-tagger", "fresh4"),
            ("accuracy-fresh5", "fresh5"), ("accuracy-fresh6", "fresh6"), ("accuracy-fresh7", "fresh7"),
            ("accuracy-fresh7-wgangp", "fresh7"), ("accuracy-fresh7-moco", "fresh7"), ("accuracy-fresh8", "fresh8"),
            ("accuracy-fresh8-bf16", "fresh8"), ("accuracy-fresh9", "fresh9"))
SET_CONTENTS = {
    "unseen": "a frozen convolutional backbone under a trainable head, a GRU language model, a pre-norm transformer "
              "encoder on dict batches, a 1-D convolutional audio classifier",
    "fresh": "a MobileNetV2-style CNN, a sequence-to-sequence nn.Transformer, a convolutional VAE, an MLP-Mixer",
    "kinds": "graph message passing, an STFT front end (complex tensors), 3-D convolutions, a custom autograd.Function "
             "with checkpointing, multi-hot EmbeddingBag tables, a diffusion block, a mixture of experts routed by "
             "the data, weight tying",
    "fresh2": "a ConvNeXt-style CNN, a PointNet, a SimCLR-style contrastive model, an FT-Transformer on tabular data",
    "fresh3": "a DenseNet, a Swin-style transformer, a NeRF-style MLP, a CTC speech model",
    "fresh4": "a Perceiver-style model, a WaveNet-style audio model, a spatial-transformer classifier, a bidirectional "
              "LSTM tagger over packed sequences",
    "fresh5": "a vision transformer that prunes its tokens, a one-stage detector with a masked box loss, a Conformer "
              "speech encoder, message passing over graphs of varying size",
    "fresh6": "a DCN-v2 recommender on multi-hot features of random length, a universal transformer with adaptive "
              "computation time, a selective state-space model, a VQ-VAE",
    "fresh7": "a WGAN-GP step (a double backward), a Fourier neural operator, MoCo v2, a capsule network",
    "fresh8": "a triplet network, a PixelShuffle super-resolution net, a RealNVP flow, a hypernetwork",
    "fresh9": "a neural ODE under RK4, sliding-window attention over unfolded keys, an SE-ResNet with stochastic depth "
              "on mixup batches, distillation from a frozen teacher",
}


def _load(stem: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{stem}.json").read_text())


def _apct(x: float | None) -> str:
    return "—" if x is None else f"{abs(x) * 100:.1f}%"


def _yes(met: bool) -> str:
    return "yes" if met else "NO"


def cpu_machine(meta: dict[str, Any]) -> str:
    """'AMD EPYC (family 25 model 17), Zen 4, 2 CPUs, glibc 2.36' from a CPU run's meta."""
    cpu = meta.get("machine", {}).get("cpu", "CPU not recorded")
    parts = [cpu, CPU_KINDS.get(cpu), f"{meta['cpu_count']} CPUs", meta.get("machine", {}).get("libc")]
    return ", ".join(p for p in parts if p)


def run_line(meta: dict[str, Any], cases: int | None = None) -> str:
    """One line: the commit, machine, date and length of an estimate_accuracy.py run."""
    took = meta.get("seconds")
    minutes = "" if not took else f", {took:.0f} s" if took < 120 else f", {took / 60:.0f} min"
    done = f"{cases} cases, " if cases is not None else ""
    return (f"Run: {done}commit `{meta['source']['git_head']}`, {cpu_machine(meta)}, torch {meta['torch']}, "
            f"started {meta['started']}{minutes}.")


def _anchors(summary: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The anchors' median / max |error| in a run's summary, e.g. '24 B/param 34.6% / 75.6%, ...'."""
    return ", ".join(f"{ANCHOR_NAMES[k.split('_vs_')[0]]} {_head(summary, k)}" for k in keys if k in summary)


def _head(summary: dict[str, Any], key: str) -> str:
    s = summary.get(key)
    return "—" if s is None else f"{_apct(s['median_abs'])} / {_apct(s['max_abs'])}"


def glance_rows() -> list[list[str]]:
    """The summary table: one row per benchmark and goal, from the results files."""
    rows = []
    for prec, stem in GRID:
        res = _load(stem)
        m, s = res["meta"], res["summary"]
        for key, what in (("ours_vs_rss", "resident set"), ("ours_vs_alloc", "live-tensor peak")):
            goal = GOALS[key]
            rows.append([f"[Presets grid, {prec}](#presets-grid-{prec}): estimate vs {what}",
                         f"median / max {_head(s, key)}", f"≤ {goal[0]:.0%} / ≤ {goal[1]:.0%}", _yes(s[key]["met"]),
                         _anchors(s, ANCHORS[key]), cpu_machine(m), f"`{m['source']['git_head']}`",
                         m["started"][:10]])
    rows += _held_out_glance() + [_largest_glance(), _speed_glance()]
    rows += [_cuda_glance(stem, gpu) for stem, gpu in (("accuracy-cuda", "H100"), ("accuracy-cuda-h200", "H200"))]
    rows += [_calibration_glance()] + _md_glance() + [_isolation_glance(), _parallel_glance(), _plan_glance()]
    return rows + [_plan_speed_glance(), _demo_glance(), _hf_glance()]


def _demo_glance() -> list[str]:
    res = _load("demo-orchestration")
    m, ex = res["meta"], res["executors"]
    dirty = ", uncommitted changes" if m["source"]["dirty"] else ""
    return ["[The demo's orchestration](#the-demos-orchestration): `make demo`'s tuning run less its measured trials",
            f"inline {ex['inline']['orchestration']:.0%} of {ex['inline']['run_wall_s']:.1f} s",
            f"< {res['goal']:.0%}", _yes(ex["inline"]["met"]),
            f"under Ray: {ex['ray']['orchestration']:.0%} of {ex['ray']['run_wall_s']:.1f} s"
            + "".join(f"; {k}: {v['orchestration']:.0%} of {v['run_wall_s']:.1f} s" for k, v in ex.items()
                      if k not in ("inline", "ray")), cpu_machine(m),
            f"`{m['source']['git_head']}`{dirty}", m["started"][:10]]


def _hf_glance() -> list[str]:
    res = _load("hf-accuracy")
    m, s = res["meta"], res["summary"]["all"]
    alloc, rss, trace = s["ours_vs_alloc"], s["ours_vs_rss"], s["trace_seconds"]
    return ["[Hugging Face models, full and LoRA](#hugging-face-models-full-and-lora): estimate vs live-tensor peak "
            "/ resident set; tracing time", f"{_head(s, 'ours_vs_alloc')}; {_head(s, 'ours_vs_rss')}; trace ≤ "
            f"{trace['max']:.1f} s", "≤ 1% / ≤ 3%; ≤ 5% / ≤ 12%; ≤ 10 s",
            f"{_yes(alloc['met'])}; {_yes(rss['met'])}; {_yes(trace['met'])}",
            f"vs live-tensor peak: accelerate {_head(s, 'accelerate_vs_alloc')}, MemTracker "
            f"{_head(s, 'memtracker_vs_alloc')}", cpu_machine(m), f"`{m['source']['git_head']}`", m["started"][:10]]


def _plan_glance() -> list[str]:
    res = _load("plan-accuracy")
    m, a, held = res["meta"], res["all"], res["check_half"]
    met = a["median_abs_error"] <= 0.10 and a["max_abs_error"] <= 0.25 and min(a["spearman"].values()) >= 0.8
    plans = res["plans"]
    compared = [p for p in plans if p["published_tokens_per_s_per_device"] is not None]
    good = sum(bool(p["top_fits"] and p.get("at_least_published")) for p in compared)
    measured = sum(bool(p["top_fits"] and p["top_tokens_per_s_per_device"]
                        >= p.get("published_measured_tokens_per_s_per_device", float("inf"))) for p in plans)
    priced = sum(bool(p.get("at_least_priced")) for p in plans)
    return ["[Planner step time](#planner-step-time): predicted vs published step time, dense BF16 H100 runs; "
            "top plan vs the published configuration",
            f"{_apct(a['median_abs_error'])} / {_apct(a['max_abs_error'])} (held-out half: "
            f"{_apct(held['median_abs_error'])} / {_apct(held['max_abs_error'])}); Spearman ≥ "
            f"{min(a['spearman'].values()):.2f}; top plan fits and ≥ the published configuration as the same model "
            f"prices it in {priced} of {len(plans)}; ≥ the published mesh run by the advisor's program in {good} of "
            f"the {len(compared)} it fits; ≥ the published runs' measured throughput in {measured} of {len(plans)}",
            "≤ 10% / ≤ 25%; ≥ 0.8; all", f"{_yes(met)}; {_yes(priced == len(plans))}",
            f"6ND rule: {_apct(a['rule_median_abs_error'])} / {_apct(a['rule_max_abs_error'])}",
            "no device (a model against published runs)", f"`{m['commit']}`", m["date"]]


def _plan_speed_glance() -> list[str]:
    res = _load("plan-speed")
    m, cases = res["meta"], res["cases"]
    dirty = ", uncommitted changes" if m["source"]["dirty"] else ""
    return ["[Planner speed](#planner-speed): `advisor plan` over the whole space, a fresh process's wall time",
            ", ".join(f"{c['label']} {c['wall_s']:.1f} s" for c in cases),
            ", ".join(f"≤ {c['goal_s']:.0f} s" for c in cases), f"{sum(c['met'] for c in cases)} of {len(cases)}", "—",
            cpu_machine(m), f"`{m['source']['git_head']}`{dirty}", m["started"][:10]]


def _parallel_glance() -> list[str]:
    res = _load("parallel-accuracy")
    m, s = res["meta"], res["summary"]
    return ["[Parallel layouts on gloo](#parallel-layouts-on-gloo): each rank's estimate vs its measured live-tensor "
            "peak; collective bytes", f"{_apct(s['median'])} / {_apct(s['max'])} (alone: {_apct(s['alone_median'])} / "
            f"{_apct(s['alone_max'])}); {100 * s['comm_max']:.2f}%", "≤ 1% / ≤ 3%; ≤ 1%",
            f"{_yes(s['median'] <= 0.01 and s['max'] <= 0.03)}; {_yes(s['comm_max'] <= 0.01)}",
            f"run-to-run spread {_apct(s['spread_median'])} / {_apct(s['spread_max'])}", cpu_machine(m),
            f"`{m['commit']}`", m["date"]]


def _held_out_glance() -> list[list[str]]:
    runs = [_load(stem) for stem, _ in HELD_OUT]
    met = sum(r["summary"]["ours_vs_rss"]["met"] and r["summary"]["ours_vs_alloc"]["met"] for r in runs)
    med = [r["summary"]["ours_vs_rss"]["median_abs"] for r in runs]
    top = [r["summary"]["ours_vs_rss"]["max_abs"] for r in runs]
    dates = sorted(r["meta"]["started"][:10] for r in runs)
    return [["[Held-out sets](#held-out-sets): estimate vs resident set and live-tensor peak",
             f"resident set: medians {_apct(min(med))}-{_apct(max(med))}, maxima {_apct(min(top))}-{_apct(max(top))}",
             "each run as the grid's", f"{met} of {len(runs)} runs", "in the section", "several", "several",
             f"{dates[0]} to {dates[-1]}"]]


def _largest_glance() -> list[str]:
    res = _load("maxbatch")
    m, rows = res["meta"], res["max_batch"]
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    return ["[Largest batch under a memory cap](#largest-batch-under-a-memory-cap) (CPU)",
            f"ours / real {min(ratios):.3f}-{max(ratios):.3f}", "0.9-1.0",
            f"{sum(r['goal_met'] for r in rows)} of {len(rows)}", "—", cpu_machine(m), f"`{m['source']['git_head']}`",
            m["started"][:10]]


def _speed_glance() -> list[str]:
    res = _load("speed")
    m, rows = res["meta"], res["speed"]
    figs = ", ".join(f"{r['label'].split(' (')[0]} {r['estimate_seconds']:.2f} s" for r in rows if "problem" not in r)
    return ["[Estimator speed](#estimator-speed)", figs, "≤ 5 s (llama-8b ≤ 30 s), < 1 GB",
            f"{sum(r['goal_met'] for r in rows)} of {len(rows)}", "—", cpu_machine(m),
            f"`{m['source']['git_head']}`", m["started"][:10]]


def _calibration_glance() -> list[str]:
    res = _load("calibration")
    m = res["meta"]
    fits = [r[tag]["max_batch"]["after_fits"] for r in res["cases"] for tag in ("calibrated", "uncalibrated")
            if "max_batch" in r[tag]]
    return ["[Measured peaks refine the estimate](#measured-peaks-refine-the-estimate): the largest batch after one "
            "trial's measured peak", f"{sum(fits)} of {len(fits)} answers fit under their cap", "—", "—", "—",
            f"{m.get('cpu', 'CPU not recorded')}, {m['cpu_count']} CPUs", f"`{m['git']}`", m["started"][:10]]


def _cuda_glance(stem: str, gpu: str) -> list[str]:
    res = _load(stem)
    m, s = res["meta"], res["summary"]
    rsv, alloc = s["ours_vs_reserved"], s["ours_vs_alloc"]
    return [f"[CUDA accuracy, {gpu}](#cuda-accuracy-{gpu.lower()}): estimate vs reserved / allocated peak",
            f"{_apct(rsv['median_abs'])} / {_apct(rsv['max_abs'])}; {_apct(alloc['median_abs'])} / "
            f"{_apct(alloc['max_abs'])}", "as the CPU grid's", f"{_yes(rsv['met'])}; {_yes(alloc['met'])}",
            _anchors(s, ANCHORS["ours_vs_reserved"]), f"{m['device']}, torch {m['torch']}",
            f"`{re.match(r'[0-9a-f]+', m['source']['git_head'])[0]}`", m["started"][:10]]


def _isolation_glance() -> list[str]:
    res = _load("isolation-latency")
    m, rows = res["meta"], res["rows"]
    over = [r["figures"]["overhead_s"] for r in rows]
    outside = max(r["figures"]["isolated_warm_outside_estimate_s"] for r in rows)
    dirty = ", uncommitted changes" if m["source"]["dirty"] else ""
    return ["[Cost of isolation](#cost-of-isolation): a warm isolated estimate less the same in process",
            f"{min(over):+.2f} to {max(over):+.2f} s over {len(rows)} workloads x hardware; outside the estimator "
            f"≤ {outside:.2f} s", f"≤ {res['goal_s']} s", f"{sum(r['met'] for r in rows)} of {len(rows)}", "—",
            cpu_machine(m), f"`{m['source']['git_head']}`{dirty}", m["started"][:10]]


def tune_stems() -> list[str]:
    """The tuner's results, one file per kind of CPU (bench/tune_bench.py: tune-amd, tune-intel-amx, ...)."""
    return sorted(p.stem for p in RESULTS.glob("tune-*.json") if p.stem not in ("tune-load", "tune-quick"))


def _tune_body() -> list[str]:
    """The tuner's results of every kind of CPU: how the bench works once (the paragraph each file opens with), then
    each file's grids, each with the command and run that measured it."""
    bodies = [_body(stem) for stem in tune_stems()]
    first = next(i for i, line in enumerate(bodies[0]) if line.startswith("Each grid is measured"))
    return [bodies[0][first], ""] + [line for body in bodies
                                     for line in body[next(i for i, x in enumerate(body) if x.startswith("### ")):]]


def _md_glance() -> list[list[str]]:
    """Rows for the benchmarks whose results are the markdown their script writes."""
    trials, cuda = (RESULTS / "trials.md").read_text(), (RESULTS / "trials-cuda.md").read_text()
    api = (RESULTS / "api_load.md").read_text()
    rows = []
    for label, text in (("Trials, CPU", trials), ("Trials, CUDA", cuda)):
        over = re.search(r"median overhead ([\d.]+ s) \(goal <= 2 s: (\w+)\)", text)
        cv = re.search(r"\| ([\d.]+%) \| (met|NOT met) \|", text)
        anchor = "measured-trials-" + label.split(", ")[1].lower()
        rows.append([f"[{label}](#{anchor}): overhead per trial; samples/s CV over 5 repeats",
                     f"{over[1]}; {cv[1]}", "≤ 2 s; ≤ 5%", f"{_yes(over[2] == 'met')}; {_yes(cv[2] == 'met')}", "—",
                     _run_of(text)[1], "—", _run_of(text)[0][:10]])
    for stem in tune_stems():
        tune = _load(stem)
        ratio = ", ".join(f"{k} ({p['workload']}) {p['median_ratio']['tpe']:.1%}" for k, p in tune["presets"].items())
        met = all(all(p["met"].values()) for p in tune["presets"].values())
        rows.append(["[Tuner](#tuner): best found with 25% of a grid / the grid's best; orchestration", ratio,
                     "≥ 95%; ≤ 20%", _yes(met), "—", tune["machine"], "—", tune["started"][:10]])
    goal = re.search(r"Goal \(p99 <= 50 ms, no errors\): met in (\d+ of \d+) runs", api)
    date = datetime.strptime(re.search(r"Date: (\w+ \w+ +\d+ [\d:]+ UTC \d+)", api)[1], "%a %b %d %H:%M:%S UTC %Y")
    rows.append(["[HTTP API under load](#http-api-under-load): 200 clients, p99 and errors", _api_best(api),
                 "p99 ≤ 50 ms, no errors", f"{goal[1]} runs", "—", re.search(r"Machine: ([^;]*);", api)[1], "—",
                 f"{date:%Y-%m-%d}"])
    return rows


def _run_of(md: str) -> tuple[str, str]:
    """(started, machine) from a trial_bench.py markdown's first 'Run ... on ...' line."""
    m = re.search(r"^Run ([\d-]+ [\d:]+) on (.*?)(?: \(a part|\.$)", md, re.M)
    return m[1], m[2]


def _api_best(md: str) -> str:
    """The closed-loop run that met the API's goal at the most requests per second, from api_load.md's table."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("| ") and "| closed |" in line and "| met |" in line]
    best = max(rows, key=lambda r: float(r[5].replace(",", "")))
    return f"{best[0]}, {best[1]}, closed loop: {best[5]} req/s, p99 {best[8]} ms"


def grid_sections() -> list[str]:
    """The presets grid: how it is measured, then each precision's summary and cases."""
    out = ["## Presets grid", "",
           "Eight presets of different kinds (resnet18, vit-b16, bert-base, gpt2-small, lstm, dlrm, unet, mlp) x "
           "{adamw, sgd-momentum} x 2 batch sizes, per precision, on this CPU. Per case: our `total_bytes` (hardware "
           "`cpu`, calibrated by short real runs at fractions of the batch) against the measured peak resident set "
           "(docs/design.md's protocol: VmHWM over the resident set before the build, 3 optimizer steps, median of 3 "
           "fresh processes); our `allocated_bytes` against the exact live-tensor peak (the profiler's allocator "
           "events replayed in order); and, against the same resident set in the same run, the anchors: 24 B/param, "
           "accelerate's `estimate-memory` rule (16 B/param), DeepSpeed's ZeRO-2 one-GPU model states (20 B/param) "
           "and PyTorch's MemTracker under FakeTensorMode (also against the live-tensor peak). Relative error = "
           "(estimate - measured) / measured; the anchors' formulas and sources are in bench/estimate_accuracy.py. "
           "The ablation rows are the same runs with one input of the estimate left out.", ""]
    for prec, stem in GRID:
        res = _load(stem)
        out += [f"### Presets grid, {prec}", "", "```bash",
                f"{FRESH_DIR} {ESTIMATE} --precisions {prec} --skip maxbatch,speed --out bench/results/{stem}.json",
                "```", "", run_line(res["meta"], len(res["cases"])), "",
                _md_table(SUMMARY_COLUMNS, summary_rows(res["summary"])), "",
                _md_table(CASE_COLUMNS, [case_row(c) for c in res["cases"]]), ""]
    return out


def _part(res: dict[str, Any], kind: str) -> str:
    """Which part of set `kind` a results file holds: its workloads and precision where not all, else all."""
    have = {c["workload"] for c in res["cases"]}
    precisions = {c["precision"] for c in res["cases"]}
    bits = [] if have == {wc.workload for wc in SETS[kind]} else [", ".join(sorted(w.split(":")[-1] for w in have))]
    bits += [f"{next(iter(precisions))} half"] if len(precisions) == 1 else []
    return "; ".join(bits) or ("whole set" if len(res["cases"]) == res["meta"]["planned_cases"] else "first cases")


def held_out_section() -> list[str]:
    """The held-out sets: one row per results file, then what each set holds."""
    cols = ["set", "run", "cases", "resident set: median / max", "live-tensor peak: median / max", "met",
            "24 B/param", "accelerate", "DeepSpeed", "MemTracker", "commit", "machine", "started"]
    rows = []
    for stem, kind in HELD_OUT:
        res = _load(stem)
        m, s = res["meta"], res["summary"]
        rows.append([f"[{kind}](bench/results/{stem}.md)", _part(res, kind),
                     f"{len(res['cases'])} of {m['planned_cases']}", _head(s, "ours_vs_rss"), _head(s, "ours_vs_alloc"),
                     _yes(s["ours_vs_rss"]["met"] and s["ours_vs_alloc"]["met"]),
                     *(_apct(s[k]["median_abs"]) if k in s else "—"
                       for k in ("rule24_vs_rss", "accelerate_vs_rss", "deepspeed_vs_rss", "memtracker_vs_rss")),
                     f"`{m['source']['git_head']}`", cpu_machine(m), m["started"]])
    return ["## Held-out sets", "",
            "Models outside the presets, written against the public Workload contract only (docs/design.md). Each "
            "`fresh` set was written, sized by one measured run per model, and committed before any estimate of it "
            "was looked at, and is not tuned against: once the estimator changes for a set's cases, a new set is "
            "written. `kinds` had one batch of each model measured before any estimate of it was looked at. Each run "
            "compares as the presets grid does, against the same goals; the anchors' columns are "
            "their median |error| against the resident set. A later run of a part of a set follows the set's whole "
            "run; each set's link opens its cases.", "", "```bash",
            f"{FRESH_DIR} {ESTIMATE} --set SET --skip maxbatch,speed --out bench/results/accuracy-SET.json", "```", "",
            _md_table(cols, rows), "", "What each set holds (bench/workloads/SET.py):", "",
            *(f"- `{kind}`: {what}." for kind, what in SET_CONTENTS.items()), ""]


def largest_section() -> list[str]:
    res = _load("maxbatch")
    return ["## Largest batch under a memory cap", "",
            "Ours: `estimate_memory(...).max_batch_size` for hardware `cpu` with the host's memory set to the cap, "
            "margin 0. Real: a bisection over batch sizes of the measured resident set (median of up to 3 runs) under "
            "the cap. The goal: ours / real between 0.9 and 1.0, never above the real largest batch.", "", "```bash",
            f"{FRESH_DIR} {ESTIMATE} --skip accuracy,speed --out bench/results/maxbatch.json", "```", "",
            run_line(res["meta"]), "", _md_table(MB_COLUMNS, [mb_row(r) for r in res["max_batch"]]), ""]


def speed_section() -> list[str]:
    res = _load("speed")
    return ["## Estimator speed", "",
            "`estimate s` is `MemoryEstimate.seconds`, the median of 3 fresh processes, from the call: it includes "
            "importing torch and torch._dynamo, which the estimator does on first use; the process's wall and CPU "
            "seconds add importing advisor. The targets are catalog GPUs, so no real run takes part.", "", "```bash",
            f"{FRESH_DIR} {ESTIMATE} --skip accuracy,maxbatch --out bench/results/speed.json", "```", "",
            run_line(res["meta"]), "", _md_table(SPEED_COLUMNS, [speed_row(r) for r in res["speed"]]), ""]


def _body(stem: str) -> list[str]:
    """A benchmark's own markdown (bench/results/STEM.md) without its title and first heading."""
    lines = (RESULTS / f"{stem}.md").read_text().rstrip("\n").splitlines()
    while lines and (not lines[0].strip() or lines[0].startswith(("# ", "## "))):
        lines.pop(0)
    return lines + [""]


def _without_cases(lines: list[str], stem: str, header: str = "| workload | prec | opt | batch |") -> list[str]:
    """`lines` with the per-case table (the one whose header row starts with `header`) left to the results file."""
    out, skipping = [], False
    for line in lines:
        if line.startswith(header):
            skipping = True
            out.append(f"Per-case table: [bench/results/{stem}.md](bench/results/{stem}.md).")
        elif skipping and not line.startswith("|"):
            skipping = False
        if not skipping:
            out.append(line)
    return out


def cuda_sections() -> list[str]:
    out = []
    for gpu, stem in (("H100", "accuracy-cuda"), ("H200", "accuracy-cuda-h200")):
        out += [f"## CUDA accuracy, {gpu}", "",
                "The CPU grid's eight presets at their own image sizes and sequence lengths, with batch sizes that put "
                "the measured peaks at 2-40 GB, on the GPU of the machine it runs on: `estimate_memory(workload, "
                "'local', ...)`, no real run, against one fresh process's max_memory_reserved and "
                "max_memory_allocated (the caching allocator is deterministic for a fixed sequence of requests). "
                "cuDNN picks convolutions' and LSTMs' algorithms, and with them their workspaces, on the device; the "
                "estimate runs those ops once there to size them.", "", "```bash",
                f"python bench/estimate_accuracy_cuda.py --out bench/results/{stem}.json   # on the GPU; "
                "bench/cuda_lease.sh runs it with the GPU tests", "```", "",
                *_without_cases(_body(stem), stem)]
    return out


def hf_section() -> list[str]:
    """Hugging Face models: how they are measured, the command, and the summary (the cases stay in the results
    file)."""
    lines = [line for line in _without_cases(_body("hf-accuracy"), "hf-accuracy", "| arch | prec | mode |")
             if line not in ("## Summary", "## Cases")]
    return ["## Hugging Face models, full and LoRA", "",
            "Twelve transformers architectures (decoders of eight families, two encoders, T5 and ViT) as tiny "
            "`config.json` workloads (`-w hf:PATH`), each trained with AdamW in fp32 and bf16, fully and with LoRA "
            "r=8 on its attention projections, on this CPU: our estimate against the measured live-tensor peak and "
            "resident set (as the presets grid measures them), beside accelerate's `estimate-memory` figure and "
            "PyTorch's MemTracker in the same run.", "", *lines]


def md_sections() -> list[str]:
    """The benchmarks whose section is the markdown their script writes (with its command, where that is not in it)."""
    parts = [
        ("Measured peaks refine the estimate", "calibration", "bench/calibration_accuracy.py",
         "Per workload: one measured trial at batch A (`probes.run_trial`, `record_peak='always'`: one fresh-process "
         "run of the CPU protocol after the trial, kept as a measured peak); then `estimate_memory` at B = 4 x A "
         "against the real peak there (median of 3), before the trial's point and after it, with the calibration "
         "runs and without; then the largest batch under a cap before and after, the answer after run 3 times."),
        ("Measured trials, CPU", "trials", "bench/trial_bench.py",
         "Goals: overhead (a trial's wall time less warm-up and timed window) ≤ 2 s for an eager trial; the "
         "coefficient of variation of samples/s over 5 repeats ≤ 5% on a compute-bound preset."),
        ("Measured trials, CUDA", "trials-cuda", "bench/trial_bench.py --device cuda", "The same, on a GPU."),
        ("Tuner", "tune", None,
         "Goals: the tuner's best ≥ 95% of the grid's best (median over seeds) with ≤ 25% of the grid's trials; "
         "tuning wall time ≤ 1.2 x the sum of the trials' wall times."),
        ("The demo's orchestration", "demo-orchestration", None,
         "How much of `make demo`'s tuning run (6 trials of a small transformer on this CPU) goes to anything "
         "but its measured trials, with the trials run by the tuner itself (`--executor inline`, the default here) "
         "and by Ray Tune on a local Ray (`--executor ray`). Goal: under 25% of the run's wall time."),
        ("The tuner beside other work", "tune-load", None,
         "What the trials measure, and how long the run takes, quiet and beside a busy process, with the trials run "
         "by Ray Tune (`--executor ray`) at niceness 0 (the tuner's default) and at Ray's default of 15. No goal: "
         "a trial on a busy host is no measurement, and the tuner waits for quiet (`settle_s`) and says when it "
         "never came."),
        ("HTTP API under load", "api_load", None,
         "`POST /v1/recommend` answered from stored results to 200 concurrent clients over loopback, against "
         "`advisor serve` in its own process. The answers come from a cache in front of the app keyed by the "
         "request's bytes (`api/fastpath.py`), checked against the store's best-generation."),
        ("Parallel layouts on gloo", "parallel-accuracy", None,
         "Each rank's estimate of a layout dp x cp x tp x pp, HSDP included "
         "(`advisor.estimate.parallel.estimate_layout`: one rank of each pipeline stage traced under a fake process "
         "group) against the same rank run for real on gloo ranks on "
         "this CPU: the live tensor bytes of all its threads (a preloaded log of every tensor storage's allocation "
         "and free; the lowest of the runs, and their spread), the same program alone in a fake process group whose "
         "collectives return at once and stage nothing (so an MLP's tensor-parallel root, which gloo's scatter "
         "makes a flat copy on, reads above it by that copy), the profiler's figure of the same runs (which misses "
         "the frees made on gloo's worker threads), and the payload bytes of its collectives by kind. Decoder "
         "shapes Llama-like, GPT-like and wide MHA, and an MLP."),
        ("Planner step time", "plan-accuracy", None,
         "The planner's step time (`advisor.plan.steptime.predict_step`, docs/planner.md) for every dense BF16 H100 "
         "training run NVIDIA published with its configuration (DGX Cloud benchmark recipes, the NeMo AutoModel "
         "performance summary), each predicted from that configuration, against the published step time, beside "
         "the usual rule (6 x parameters x tokens at half the peak). The compute efficiencies are fitted on every "
         "other row and checked on the rest."),
        ("Planner speed", "plan-speed", "bench/plan_speed.py",
         "How long `advisor plan` takes over the whole space of meshes, strategies, schedules, micro-batches, "
         "checkpointing and offload (docs/planner.md), as a user runs it. Goals: llama-70b on 64 H100s in at most "
         "10 s, on 1,024 H100s in at most 30 s."),
        ("Cost of isolation", "isolation-latency", None,
         "What running a named workload's estimate in an isolated worker (`advisor.isolation.estimate`, the path of "
         "the CLI, the trial runner, the tuner and the API) costs beside `estimate_memory` in the caller's process, "
         "cold and warm. Goal: at most 0.5 s more per estimate once warm."),
    ]
    out = []
    for title, stem, command, method in parts:
        run = ["```bash", f".venv/bin/python {command}", "```", ""] if command else []
        body = _without_cases(_body(stem), stem, "| model | GPUs | configuration") if stem == "plan-accuracy" \
            else _tune_body() if stem == "tune" else _body(stem)
        out += [f"## {title}", "", method, "", *run, *body]
    return out


def compose() -> str:
    head = ["# Benchmarks", "",
            "What the advisor's benchmarks measure, each beside its goal and the anchors of the same run, with the "
            "command, commit, machine and date of its current run. This page is written by "
            "`.venv/bin/python bench/compose_benchmarks.py` from `bench/results/`: a re-run replaces its results "
            "file there, then that command rewrites the page. Superseded runs are in git's history; "
            "bench/research/README.md lists the scripts behind the estimator's constants.", "",
            "## At a glance", "",
            _md_table(["benchmark", "figure", "goal", "met", "anchors of the same run: median / max |error|", "machine",
                       "commit", "date"], glance_rows()), ""]
    body = grid_sections() + held_out_section() + largest_section() + speed_section() + cuda_sections() + hf_section()
    return "\n".join(head + body + md_sections()).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where BENCHMARKS.md is not what this would write")
    args = ap.parse_args(argv)
    text = compose()
    if args.check:
        same = BENCHMARKS.exists() and BENCHMARKS.read_text() == text
        print(f"{BENCHMARKS}: {'up to date' if same else 'differs: run bench/compose_benchmarks.py'}")
        return 0 if same else 1
    BENCHMARKS.write_text(text)
    print(BENCHMARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
