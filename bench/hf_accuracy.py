#!/usr/bin/env python
"""How close is `estimate_memory` to what a CPU training step of a Hugging Face model really uses, full and LoRA.

    .venv/bin/python bench/hf_accuracy.py [--quick] [--only llama,t5] [--out bench/results/hf-accuracy.json]
        [--resume] [--render-only]

Each architecture is a tiny config.json this script writes (2 layers, width 256, vocabulary 8192, 128 tokens;
ViT: 128 px in 16 px patches), loaded as the workload `hf:DIR` (advisor/presets/hf.py), and trained with AdamW
in fp32 and bf16 autocast, fully and with LoRA (r=8 on the attention projections the family names, peft).
Per case, as bench/estimate_accuracy.py measures (its helpers are reused):
- measured: the resident set (median of 3 fresh-process `measure(mode='rss')` runs, 2 more where they spread
  over WIDE_SPREAD) and the exact allocated peak (one `measure(mode='alloc')` run);
- ours: `estimate_memory(..., 'cpu', calibrate=True)`'s total_bytes vs the resident set and allocated_bytes vs
  the allocated peak; the tracing time is MemoryEstimate.seconds of the same estimate with no real run
  (calibrate=False), beside its process CPU seconds;
- accelerate: `accelerate estimate-memory`'s "Training using Adam" figure (see accelerate_rule);
- MemTracker: torch.distributed._tools.mem_tracker under FakeTensorMode around the same build (frozen base cast
  as the trial casts it) and 2 train_steps, against both measured peaks.
Batch sizes are 16 (ViT 32): from 16 up the calibrated estimate runs no step at the batch itself
(advisor/estimate/resident/calibrate.py, AT_BATCH_BELOW), so the resident set is predicted, not measured.
Run with ADVISOR_DATA_DIR unset and a fresh data directory is made, so no calibration of another run takes part.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.estimate_accuracy import (  # noqa: E402
    MORE_RUNS,
    WIDE_SPREAD,
    WorkloadCase,
    _apct,
    _atomic_write,
    _child,
    _load_avg,
    _md_table,
    _median_int,
    _pct,
    machine,
    rel,
    source_fingerprint,
    spread,
)

MB = 1e6
GOALS = {"ours_vs_alloc": (0.01, 0.03), "ours_vs_rss": (0.05, 0.12)}
TRACE_GOAL_S = 10.0  # seconds of one estimate with no real run (the trace), each case
SEQ_LEN = 128  # tokens per sample
BATCH, VIT_BATCH = 16, 32  # samples
LORA_R = 8
COMMAND = ".venv/bin/python bench/hf_accuracy.py"

# ----------------------------------------------------------------------------------------------------------
# The architectures: tiny configs of real families, each with the attention projections LoRA wraps there.

_H, _V = 256, 8192  # width, vocabulary
_DEC = dict(hidden_size=_H, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, vocab_size=_V,
            max_position_embeddings=256)
_ENC = dict(hidden_size=_H, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, vocab_size=_V,
            max_position_embeddings=258)


@dataclass(frozen=True)
class Arch:
    name: str  # the config's directory, and the workload's label
    kind: str
    config: dict[str, Any] = field(hash=False)
    targets: tuple[str, ...]  # LoRA target_modules
    tokens: bool = True  # a token model (seq_len applies), else images


ARCHS: list[Arch] = [
    Arch("llama", "decoder (GQA, SwiGLU, RoPE)",
         {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_DEC, "num_key_value_heads": 2},
         ("q_proj", "v_proj")),
    Arch("mistral", "decoder (GQA, SwiGLU, RoPE)",
         {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **_DEC, "num_key_value_heads": 2,
          "sliding_window": None}, ("q_proj", "v_proj")),
    Arch("qwen2", "decoder (GQA, qkv biases)",
         {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_DEC, "num_key_value_heads": 2},
         ("q_proj", "v_proj")),
    Arch("gemma", "decoder (MQA, GeGLU, tied)",
         {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **_DEC, "num_key_value_heads": 1,
          "head_dim": 64}, ("q_proj", "v_proj")),
    Arch("phi", "decoder (parallel attention + MLP, partial RoPE)",
         {"architectures": ["PhiForCausalLM"], "model_type": "phi", **_DEC, "intermediate_size": 1024},
         ("q_proj", "v_proj")),
    Arch("gpt2", "decoder (fused qkv Conv1D, learned positions, tied)",
         {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": _H, "n_layer": 2, "n_head": 4,
          "vocab_size": _V, "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0}, ("c_attn",)),
    Arch("gpt_neox", "decoder (fused qkv, parallel residual)",
         {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **_DEC, "intermediate_size": 1024},
         ("query_key_value",)),
    Arch("opt", "decoder (ReLU MLP, learned positions, tied)",
         {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": _H, "ffn_dim": 1024,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": _V, "max_position_embeddings": 256,
          "word_embed_proj_dim": _H}, ("q_proj", "v_proj")),
    Arch("bert", "encoder, masked LM",
         {"architectures": ["BertForMaskedLM"], "model_type": "bert", **_ENC}, ("query", "value")),
    Arch("roberta", "encoder, sequence classification",
         {"architectures": ["RobertaForSequenceClassification"], "model_type": "roberta", **_ENC, "num_labels": 4,
          "pad_token_id": 1}, ("query", "value")),
    # decoder_start_token_id as T5's released configs give it
    Arch("t5", "encoder-decoder (relative position bias)",
         {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": _H, "d_kv": 64,
          "d_ff": 1024, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "vocab_size": _V,
          "decoder_start_token_id": 0}, ("q", "v")),
    Arch("vit", "vision transformer, image classification",
         {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": _H,
          "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 128,
          "patch_size": 16, "num_labels": 10}, ("q_proj", "v_proj"), tokens=False),
]
PRECISIONS = ("fp32", "bf16")
MODES = ("full", "lora")


@dataclass(frozen=True)
class Case:
    arch: Arch
    precision: str
    mode: str

    @property
    def key(self) -> str:
        return f"{self.arch.name}|{self.precision}|{self.mode}"

    @property
    def batch(self) -> int:
        return BATCH if self.arch.tokens else VIT_BATCH

    def workload(self, config_dir: Path) -> WorkloadCase:
        """The case as bench/estimate_accuracy.py's helpers take it: the workload and its args (LoRA among them)."""
        from advisor.finetune import FineTune, LoraSpec, with_finetune

        args: dict[str, Any] = {"seq_len": SEQ_LEN} if self.arch.tokens else {}
        if self.mode == "lora":
            args = with_finetune(args, FineTune(lora=LoraSpec(r=LORA_R, targets=self.arch.targets)))
        return WorkloadCase(self.arch.kind, f"hf:{config_dir / self.arch.name}", args, (self.batch, self.batch))


def write_configs(config_dir: Path, archs: list[Arch]) -> None:
    for arch in archs:
        (config_dir / arch.name).mkdir(parents=True, exist_ok=True)
        (config_dir / arch.name / "config.json").write_text(json.dumps(arch.config, indent=1))


# ----------------------------------------------------------------------------------------------------------
# Anchors


def accelerate_rule(config_file: Path, precision: str) -> dict[str, Any]:
    """`accelerate estimate-memory`'s "Training using Adam" figure for this config (bytes), computed with the
    installed accelerate's own functions as its CLI does (src/accelerate/commands/estimate.py, gather_data):
    the model built empty by AutoModel.from_config in fp32 (the CLI's constructor for a transformers model: the
    base model, without the task head), its size by calculate_maximum_sizes (parameters and buffers), and
    max(estimate_training_usage(size, dtype).values()): 4 x size for "float32" (the step: model, gradients and
    two Adam moments), 2 x size for "float16" (the row for bf16 autocast, which the function treats alike).
    It knows nothing of adapters or frozen parameters: a LoRA case gets the full-training figure."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(str(config_file), local_files_only=True)
    with init_empty_weights():
        model = AutoModel.from_config(config, dtype=torch.float32)
    size, _ = calculate_maximum_sizes(model)
    dtype = "float32" if precision == "fp32" else "float16"
    return {"bytes": int(max(estimate_training_usage(size, dtype).values())), "model_bytes": int(size),
            "dtype_row": dtype}


def memtracker_peak(workload: str, args: dict[str, Any], batch: int, precision: str) -> dict[str, Any]:
    """Peak of PyTorch's MemTracker over the build and 2 fake AdamW training steps (run in a child process), the
    frozen base held as a trial holds it (advisor.finetune.hold_frozen)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.fake_build import build_batch, fake_conversions
    from advisor.finetune import hold_frozen
    from advisor.training import prepare, train_step
    from advisor.workload import load_workload

    t0 = time.perf_counter()
    wl = load_workload(workload, args)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    # fake_conversions: peft moves each adapter with Module.to, which swaps fake tensors, and torch refuses to swap
    # one that a weak reference points to (fake tensors have them); the estimator's trace sets the data instead
    with fake_mode, fake_conversions():
        tracker = MemTracker()
        with tracker:
            torch.manual_seed(0)
            model = hold_frozen(_fake_build(wl), precision)
            _frozen_unhooked(tracker, model)
            ctx = prepare(model, wl.loss_fn, precision=Precision(precision), optimizer=OptimizerKind.adamw,
                          device_type="cpu", fake=True)
            for _ in range(2):
                train_step(ctx, build_batch(wl, batch, fake_mode))
                tracker.reset_mod_stats()  # MemTracker refuses a second forward of a module without this
        snap = tracker.get_tracker_snapshot("peak")
    parts: dict[str, int] = {}
    for dev in snap.values():
        for k, v in dev.items():
            parts[getattr(k, "value", str(k))] = parts.get(getattr(k, "value", str(k)), 0) + int(v)
    return {"peak_bytes": parts.pop("Total"), "parts": parts, "seconds": time.perf_counter() - t0}


def _fake_build(wl: Any) -> Any:
    """The workload's model on fake tensors; where its build reads a value fake tensors do not have (ViT's
    trunc_normal_), built again with the initializers skipped as the estimator's trace builds it (initial values
    change no memory)."""
    from advisor.estimate.fake_build import _initializers_skipped

    try:
        return wl.build_model()
    except Exception as exc:
        if "DataDependent" not in type(exc).__name__:
            raise
    with _initializers_skipped():
        return wl.build_model()


def _frozen_unhooked(tracker: Any, model: Any) -> None:
    """MemTracker (torch 2.13) registers a gradient hook on every parameter a forward reaches, which torch refuses
    for a frozen one; its frozen parameters are marked hooked already, so it runs. They have no gradient to count,
    and their bytes are still counted as parameters."""
    class NoHook:
        def remove(self) -> None:  # what the tracker calls on each of its hooks at exit
            return None

    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (NoHook(), NoHook())


def model_states(wc: WorkloadCase, precision: str) -> dict[str, int]:
    """The model's exact parameter and buffer bytes as a trial holds them, and its trained parameters' bytes (each
    has a gradient of its size, and two fp32 AdamW moments)."""
    import torch

    from advisor.finetune import hold_frozen
    from advisor.workload import load_workload

    with torch.device("meta"):
        model = hold_frozen(load_workload(wc.workload, wc.args).build_model(), precision)
    params = list(model.parameters())
    return {"num_params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": sum(p.numel() * p.element_size() for p in params)
            + sum(b.numel() * b.element_size() for b in model.buffers()),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad)}


# ----------------------------------------------------------------------------------------------------------
# One case


def run_case(case: Case, config_dir: Path, pool: ThreadPoolExecutor, quick: bool, status) -> dict[str, Any]:
    """Measure one case, estimate it, and every error against its measured peaks."""
    from advisor.measure import MeasureRequest, measure

    wc = case.workload(config_dir)
    rec: dict[str, Any] = {"key": case.key, "arch": case.arch.name, "kind": case.arch.kind,
                           "precision": case.precision, "mode": case.mode, "batch_size": case.batch,
                           "lora_targets": list(case.arch.targets) if case.mode == "lora" else None,
                           "config": case.arch.config, "problems": [], "measured_on": machine(),
                           "advisor_sha256": source_fingerprint()["sha256"]}
    t0 = time.perf_counter()
    req = dict(workload=wc.workload, workload_args=wc.args, batch_size=case.batch, precision=case.precision)
    status("measuring (resident set, allocated peak, MemTracker)")
    rss_f = [pool.submit(measure, MeasureRequest(**req, mode="rss")) for _ in range(1 if quick else 3)]
    alloc_f = pool.submit(measure, MeasureRequest(**req, mode="alloc"))
    mt_f = pool.submit(_child, "memtracker", dict(workload=wc.workload, args=wc.args, batch=case.batch,
                                                  precision=case.precision), 900.0, Path(__file__).resolve())
    rec["rss_runs"] = _results(rss_f, "rss measure", rec, lambda r: int(r.rss_delta_bytes))
    if len(rec["rss_runs"]) == 3 and spread(rec["rss_runs"]) > WIDE_SPREAD:
        status(f"3 runs spread {spread(rec['rss_runs']):.0%}: {MORE_RUNS} more")
        more = [pool.submit(measure, MeasureRequest(**req, mode="rss")) for _ in range(MORE_RUNS)]
        rec["rss_runs_more"] = _results(more, "rss measure (more)", rec, lambda r: int(r.rss_delta_bytes))
    runs = rec["rss_runs"] + rec.get("rss_runs_more", [])
    rec["rss_bytes"] = _median_int(rec["rss_runs"]) if rec["rss_runs"] else None
    rec["rss_all_runs_bytes"] = _median_int(runs) if runs else None
    rec["alloc_bytes"] = (_results([alloc_f], "alloc measure", rec, lambda r: int(r.alloc_peak_bytes)) or [None])[0]
    mt = (_results([mt_f], "memtracker", rec, lambda r: r) or [None])[0]
    if mt:
        rec.update(memtracker_bytes=mt["peak_bytes"], memtracker_parts=mt["parts"], memtracker_seconds=mt["seconds"])
    rec.update(model_states(wc, case.precision))
    status("estimating (trace, then calibrated on this CPU)")
    estimate(case, wc, rec)
    rec["accelerate"] = accelerate_rule(config_dir / case.arch.name / "config.json", case.precision)
    rec["errors"] = errors(rec)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _results(futures, what: str, rec: dict[str, Any], value) -> list[Any]:
    out = []
    for f in futures:
        try:
            out.append(value(f.result()))
        except Exception as exc:  # noqa: BLE001 - a benchmark records a failed run and goes on
            rec["problems"].append(f"{what}: {type(exc).__name__}: {exc}")
    return out


def estimate(case: Case, wc: WorkloadCase, rec: dict[str, Any]) -> None:
    """Ours, in place: the trace alone (no real run: its seconds are the tracing goal's), then the estimate
    calibrated on this CPU."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    req = EstimateRequest(batch_size=case.batch, precision=case.precision, optimizer="adamw")
    try:
        c0 = time.process_time()
        trace = estimate_memory(wc.workload, "cpu", req, EstimateOptions(calibrate=False, measured=False),
                                workload_args=wc.args)
        rec.update(trace_seconds=trace.seconds, trace_cpu_seconds=time.process_time() - c0,
                   trace_allocated_bytes=trace.allocated_bytes, trace_load_avg=_load_avg())
        est = estimate_memory(wc.workload, "cpu", req, EstimateOptions(calibrate=True, measured=False),
                              workload_args=wc.args)
    except Exception as exc:  # noqa: BLE001 - record and go on
        rec["problems"].append(f"estimate: {type(exc).__name__}: {exc}")
        return
    rec.update(est_total_bytes=est.total_bytes, est_allocated_bytes=est.allocated_bytes, method=est.method,
               calibrated=est.calibrated, est_seconds=est.seconds, est_workload=est.workload,
               breakdown=est.breakdown.model_dump(), notes=est.notes)
    if any("real run(s) at the batch itself" in n for n in est.notes):
        rec["problems"].append("the calibration ran steps at the batch itself: its resident set was measured")


def errors(rec: dict[str, Any]) -> dict[str, float | None]:
    """Relative errors, (estimate - measured) / measured, of ours and the anchors against both measured peaks."""
    rss, alloc, acc = rec.get("rss_bytes"), rec.get("alloc_bytes"), rec["accelerate"]["bytes"]
    return {"ours_vs_rss": rel(rec.get("est_total_bytes"), rss),
            "ours_vs_rss_all_runs": rel(rec.get("est_total_bytes"), rec.get("rss_all_runs_bytes")),
            "ours_vs_alloc": rel(rec.get("est_allocated_bytes"), alloc),
            "accelerate_vs_rss": rel(acc, rss), "accelerate_vs_alloc": rel(acc, alloc),
            "memtracker_vs_rss": rel(rec.get("memtracker_bytes"), rss),
            "memtracker_vs_alloc": rel(rec.get("memtracker_bytes"), alloc)}


# ----------------------------------------------------------------------------------------------------------
# Summary and output

ERROR_ROWS = [
    ("ours_vs_alloc", "ours (allocated) vs allocated peak"),
    ("accelerate_vs_alloc", "accelerate estimate-memory vs allocated peak"),
    ("memtracker_vs_alloc", "MemTracker (FakeTensorMode) vs allocated peak"),
    ("ours_vs_rss", "ours (total, calibrated) vs resident set"),
    ("ours_vs_rss_all_runs", f"ours (total) vs resident set, median of {3 + MORE_RUNS} runs where 3 spread over "
                             f"{WIDE_SPREAD:.0%}"),
    ("accelerate_vs_rss", "accelerate estimate-memory vs resident set"),
    ("memtracker_vs_rss", "MemTracker (FakeTensorMode) vs resident set"),
]


def summarize(cases: list[dict[str, Any]], subset: str = "all") -> dict[str, Any]:
    """Median and max |error| per comparison over `cases` (those of one mode where `subset` names it)."""
    chosen = [c for c in cases if subset == "all" or c["mode"] == subset]
    out: dict[str, Any] = {}
    for key, label in ERROR_ROWS:
        signed = [c["errors"][key] for c in chosen if c.get("errors", {}).get(key) is not None]
        vals = [abs(v) for v in signed]
        row: dict[str, Any] = {"label": label, "n": len(vals), "median_abs": statistics.median(vals) if vals else None,
                               "max_abs": max(vals) if vals else None,
                               "median_signed": statistics.median(signed) if signed else None}
        if key in GOALS:
            row["goal_median"], row["goal_max"] = GOALS[key]
            row["met"] = bool(vals) and row["median_abs"] <= GOALS[key][0] and row["max_abs"] <= GOALS[key][1]
        out[key] = row
    secs = [c["trace_seconds"] for c in chosen if c.get("trace_seconds") is not None]
    out["trace_seconds"] = {"label": f"tracing seconds (estimate with no real run), goal ≤ {TRACE_GOAL_S:.0f} s each",
                            "n": len(secs), "median": statistics.median(secs) if secs else None,
                            "max": max(secs) if secs else None, "met": bool(secs) and max(secs) <= TRACE_GOAL_S}
    return out


SUMMARY_COLUMNS = ["comparison", "cases", "all: median / max", "full: median / max", "LoRA: median / max",
                   "median (signed)", "goal", "met"]


def summary_rows(summaries: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for key, _ in ERROR_ROWS:
        s = summaries["all"][key]
        goal = f"median ≤ {s['goal_median']:.0%}, max ≤ {s['goal_max']:.0%}" if "goal_median" in s else ""
        rows.append([s["label"], str(s["n"]),
                     *(f"{_apct(summaries[k][key]['median_abs'])} / {_apct(summaries[k][key]['max_abs'])}"
                       for k in ("all", "full", "lora")),
                     _pct(s["median_signed"]), goal, ("met" if s["met"] else "NOT met") if "met" in s else ""])
    t = summaries["all"]["trace_seconds"]
    if t["n"]:
        rows.append([t["label"], str(t["n"]),
                     *(f"{summaries[k]['trace_seconds']['median']:.1f} / {summaries[k]['trace_seconds']['max']:.1f} s"
                       if summaries[k]["trace_seconds"]["n"] else "—" for k in ("all", "full", "lora")),
                     "", f"≤ {TRACE_GOAL_S:.0f} s each", "met" if t["met"] else "NOT met"])
    return rows


CASE_COLUMNS = ["arch", "prec", "mode", "batch", "params (M)", "trained (M)", "RSS MB", "alloc MB", "ours MB",
                "ours vs RSS", "ours alloc MB", "ours vs alloc", "accelerate MB",
                "accel. vs RSS", "accel. vs alloc", "MemTracker vs RSS", "MemTracker vs alloc", "trace s"]


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / MB:.1f}"


def case_row(c: dict[str, Any]) -> list[str]:
    e = c.get("errors", {})
    return [c["arch"], c["precision"], c["mode"], str(c["batch_size"]),
            f"{c['num_params'] / 1e6:.2f}" if c.get("num_params") else "—",
            f"{c['trainable_params'] / 1e6:.3f}" if c.get("trainable_params") else "—",
            _mb(c.get("rss_bytes")), _mb(c.get("alloc_bytes")), _mb(c.get("est_total_bytes")),
            _pct(e.get("ours_vs_rss")),
            _mb(c.get("est_allocated_bytes")), _pct(e.get("ours_vs_alloc")),
            _mb(c.get("accelerate", {}).get("bytes")), _pct(e.get("accelerate_vs_rss")),
            _pct(e.get("accelerate_vs_alloc")), _pct(e.get("memtracker_vs_rss")), _pct(e.get("memtracker_vs_alloc")),
            "—" if c.get("trace_seconds") is None else f"{c['trace_seconds']:.1f}"]


def all_summaries(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: summarize(cases, k) for k in ("all", "full", "lora")}


def _shas(cases: list[dict[str, Any]], run_sha: str) -> str:
    """The advisor sources' hash the cases were estimated with: the run's, or each with its count of cases where
    cases kept from an earlier run (--resume) had other sources."""
    counts = Counter(c.get("advisor_sha256", "not recorded") for c in cases)
    return run_sha if set(counts) == {run_sha} else ", ".join(f"{sha} for {n} cases" for sha, n in counts.items())


def write_markdown(path: Path, results: dict[str, Any]) -> None:
    meta, cases = results["meta"], results["cases"]
    src = meta["source"]
    arch_lines = [f"- `{a['name']}` ({a['kind']}): LoRA targets {', '.join(a['targets'])}"
                  for a in meta["archs"]]
    parts = [
        "# Hugging Face models: estimator accuracy, full and LoRA (bench/hf_accuracy.py)", "",
        f"Command: `{COMMAND}`" + ("" if meta["command"] == COMMAND else f"; this file: `{meta['command']}`")
        + (f", {meta['kept_cases']} cases kept from an earlier run" if meta.get("kept_cases") else "") + ".", "",
        f"Commit `{src['git_head']}` (advisor sources sha256 {_shas(cases, src['sha256'])}"
        + (", CHANGED during the run" if meta.get("source_changed_during_run") else "") + f"); machine: "
        f"{meta['machine']['cpu']}, {meta['cpu_count']} CPUs, kernel {meta['machine']['kernel']}, "
        f"{meta['machine']['libc']}; torch {meta['torch']}, transformers {meta['transformers']}, peft {meta['peft']}, "
        f"accelerate {meta['accelerate']}; started {meta['started']}"
        + (f", {meta['seconds'] / 60:.0f} min" if meta.get("seconds") else " (in progress)")
        + f"; {len(cases)} cases.", "",
        f"Each architecture is a tiny config (2 layers, width {_H}, vocabulary {_V}, {SEQ_LEN} tokens; ViT 128 px "
        f"in 16 px patches) built by transformers with random weights, trained with AdamW at batch {BATCH} "
        f"(ViT {VIT_BATCH}) in fp32 and bf16 autocast, fully and with LoRA r={LORA_R} (peft; the base frozen, "
        "held in bf16 under bf16). Measured: the resident set (VmHWM over the resident set before the build, 3 "
        "optimizer steps, median of 3 fresh processes) and the exact allocated peak (profiler memory events "
        "replayed in order). Ours: `estimate_memory(hf:DIR, 'cpu', calibrate=True)`, total vs the resident set, "
        "allocated vs the allocated peak; tracing time: the same estimate with no real run. accelerate: "
        "`accelerate estimate-memory`'s \"Training using Adam\" column computed with accelerate's own functions "
        "(the base model by AutoModel, 4 x its fp32 size for float32, 2 x for the float16 row used for bf16; "
        "the same figure for LoRA, which it does not model). MemTracker: "
        "torch.distributed._tools.mem_tracker under FakeTensorMode over the build and 2 steps (it hooks every "
        "parameter's gradient, which torch refuses for a frozen one: the bench marks those hooked; a build that "
        "reads initial values is built with the initializers skipped, as our trace builds it). Relative error = "
        "(estimate − measured) / measured.", "",
        "### Summary", "", _md_table(SUMMARY_COLUMNS, summary_rows(all_summaries(cases))), "",
        "### Cases", "", _md_table(CASE_COLUMNS, [case_row(c) for c in cases]), "",
        "Architectures:", "", *arch_lines, ""]
    probs = [(c["key"], p) for c in cases for p in c.get("problems", [])]
    if probs:
        parts += ["Problems:", ""] + [f"- `{k}`: {p}" for k, p in probs] + [""]
    _atomic_write(path, "\n".join(parts))


# ----------------------------------------------------------------------------------------------------------


def _meta(args: argparse.Namespace, plan: list[Case], archs: list[Arch]) -> dict[str, Any]:
    from importlib.metadata import version

    import torch

    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": version("transformers"), "peft": version("peft"),
            "accelerate": version("accelerate"), "python": platform.python_version(), "quick": args.quick,
            "planned_cases": len(plan), "command": " ".join([COMMAND, *sys.argv[1:]]),
            "load_avg_start": _load_avg(), "finished": False, "source": source_fingerprint(), "machine": machine(),
            "goals": {**GOALS, "trace_seconds": TRACE_GOAL_S},
            "archs": [{"name": a.name, "kind": a.kind, "targets": list(a.targets)} for a in archs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case (llama, bf16, LoRA) and one resident-set run: a "
                    "smoke test")
    ap.add_argument("--only", default=None, help="comma-separated architectures to measure (again, with --resume, "
                    f"where --out has them; the others' kept cases stay): {', '.join(a.name for a in ARCHS)}")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/hf-accuracy.json, "
                    "hf-accuracy-quick.json with --quick); the markdown goes beside it with a .md suffix")
    ap.add_argument("--resume", action="store_true", help="keep the cases already in --out and run only the rest")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out")
    ap.add_argument("--child-memtracker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_memtracker:
        print(json.dumps(memtracker_peak(**json.loads(args.child_memtracker))))
        return 0
    out = (args.out or ROOT / "bench" / "results" / ("hf-accuracy-quick.json" if args.quick
                                                     else "hf-accuracy.json")).resolve()
    md = out.with_suffix(".md")
    if args.render_only:
        write_markdown(md, json.loads(out.read_text()))
        print(f"markdown: {md}")
        return 0
    faulthandler.enable()  # a crash in native code leaves its stack in the log
    os.environ.setdefault("ADVISOR_DATA_DIR", tempfile.mkdtemp(prefix="hf-accuracy-"))
    import logging

    logging.getLogger("advisor").setLevel(logging.ERROR)
    names = {a.name for a in ARCHS}
    only = {n.strip() for n in args.only.split(",")} if args.only else names
    if only - names:
        ap.error(f"unknown architecture {', '.join(sorted(only - names))}; allowed: {', '.join(a.name for a in ARCHS)}")
    archs = [a for a in ARCHS if a.name == "llama"] if args.quick else [a for a in ARCHS if a.name in only]
    # every architecture's four cases together, so a partial run compares full and LoRA on the same models
    plan = [Case(a, "bf16", "lora") for a in archs] if args.quick else \
        [Case(a, p, m) for a in archs for p in PRECISIONS for m in MODES]
    config_dir = Path(os.environ["ADVISOR_DATA_DIR"]) / "hf-configs"
    write_configs(config_dir, archs)
    results = {"meta": _meta(args, plan, archs), "cases": []}
    previous = json.loads(out.read_text())["cases"] if args.resume and out.exists() else []
    # --only measures its architectures again; the other kept cases stay as they are
    kept = {c["key"]: c for c in previous if not (args.only and c["arch"] in only)}
    results["meta"]["kept_cases"] = len(kept)
    run(plan, kept, results, config_dir, out, md, args.quick)
    return 0


def run(plan: list[Case], kept: dict[str, dict[str, Any]], results: dict[str, Any], config_dir: Path, out: Path,
        md: Path, quick: bool) -> None:
    """Every case of `plan` not in `kept`, saved after each with the kept ones, in the grid's order."""
    t_start = time.perf_counter()
    order = [Case(a, p, m).key for a in ARCHS for p in PRECISIONS for m in MODES]

    def save() -> list[dict[str, Any]]:
        cases = results["cases"] + list(kept.values())
        cases.sort(key=lambda c: order.index(c["key"]) if c["key"] in order else len(order))
        summaries = all_summaries(cases)
        _atomic_write(out, json.dumps({**results, "cases": cases, "summary": summaries}, indent=1, default=str))
        write_markdown(md, {**results, "cases": cases})
        return cases

    with ThreadPoolExecutor(max_workers=2) as pool:  # resident sets are per process: two runs at a time
        todo = [c for c in plan if c.key not in kept]
        for i, case in enumerate(todo, 1):

            def status(msg: str, _case=case, _i=i) -> None:
                print(f"[{_i}/{len(todo)}] {_case.key}: {msg}", flush=True)

            try:
                rec = run_case(case, config_dir, pool, quick, status)
            except Exception as exc:  # noqa: BLE001 - a benchmark goes on past one broken case
                rec = {"key": case.key, "arch": case.arch.name, "kind": case.arch.kind, "precision": case.precision,
                       "mode": case.mode, "batch_size": case.batch, "errors": {},
                       "problems": [f"case failed: {type(exc).__name__}: {exc}"]}
            results["cases"].append(rec)
            e = rec["errors"]
            status(f"RSS {_mb(rec.get('rss_bytes'))} MB, ours {_pct(e.get('ours_vs_rss'))}; alloc "
                   f"{_mb(rec.get('alloc_bytes'))} MB, ours {_pct(e.get('ours_vs_alloc'))}, accelerate "
                   f"{_pct(e.get('accelerate_vs_alloc'))}, MemTracker {_pct(e.get('memtracker_vs_alloc'))}; trace "
                   f"{rec.get('trace_seconds', float('nan')):.1f} s; case {rec.get('seconds', 0):.0f} s"
                   + (f"; problems: {'; '.join(rec['problems'])}" if rec.get("problems") else ""))
            save()
    meta = results["meta"]
    meta.update(finished=True, seconds=time.perf_counter() - t_start, load_avg_end=_load_avg())
    if source_fingerprint()["sha256"] != meta["source"]["sha256"]:
        meta["source_changed_during_run"] = True
    for row in summary_rows(all_summaries(save())):
        print(" | ".join(row))
    print(f"results: {out}  markdown: {md}")


if __name__ == "__main__":
    sys.exit(main())
