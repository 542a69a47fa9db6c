"""The planner's step time against published training runs: ../shared/published_perf/nvidia.jsonl's dense BF16
H100 rows, each predicted from its exact configuration (`advisor.plan.steptime.predict_step`), beside the usual
rule (6 x parameters x tokens at half the peak).

Each row's model is a decoder of its published shape; its family sets what the row does not (GPT-3: GELU MLP,
LayerNorm, learned positions, biases; Nemotron-4: a two-matrix MLP (squared ReLU), LayerNorm; the rest: SwiGLU,
RMSNorm). Megatron's distributed optimizer reduces each gradient once a step, bucket by bucket beside the last
micro-batch's backward (reduce-scatter, then all-gather of the parameters: the bytes of DDP's all-reduce), so its
rows are priced as DDP; rows with `fsdp` run FSDP (ZeRO-3). BF16 in Megatron keeps bf16 parameters and
activations: `bf16-pure` here. Rows left out, each with its reason: MoE and reduced-layer proxies (not dense), LoRA
fine-tuning (frozen base weights), FP8.

`--fit` searches the compute efficiencies on the rows of every other configuration (sorted by model, GPUs and
mesh) and reports both halves, so the figures on the held-out half are a check of the fit.

    .venv/bin/python bench/plan_accuracy.py [--fit] [--out bench/results/plan-accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PUBLISHED = ROOT.parent / "shared" / "published_perf" / "nvidia.jsonl"


def family(model: str) -> dict:
    """What a row's model name says of its architecture beyond the published numbers."""
    if model.startswith("GPT-3"):
        return {"gated_ffn": False, "norm": "layernorm", "learned_positions": True, "bias": True}
    if model.startswith("Nemotron-4"):
        return {"gated_ffn": False, "norm": "layernorm", "learned_positions": False, "bias": False}
    return {"gated_ffn": True, "norm": "rmsnorm", "learned_positions": False, "bias": False}


def excluded(row: dict) -> str | None:
    """Why a row is not judged, or None."""
    notes = (row.get("notes") or "").lower()
    if row["precision"] != "BF16":
        return f"precision {row['precision']}"
    if "H100" not in (row.get("gpu") or ""):
        return f"gpu {row['gpu']}"
    if (row.get("ep") or 1) > 1 or re.search(r"\bmoe(:| \(| hybrid)", notes) or "moe" in row["model"].lower():
        return "MoE"
    if "proxy" in notes or "reduced-layer" in notes:
        return "reduced-layer proxy"
    if "lora" in row["model"].lower() or "lora fine-tuning" in notes or "peft" in notes:
        return "LoRA: frozen base weights are not in the step-time model"
    if row.get("step_time_s") is None or row.get("layers") is None or row.get("ffn") is None:
        return "no step time or no architecture"
    return None


_CASES: dict[str, tuple] = {}


def case(row: dict):
    """(arch, hardware, layout, knobs) of a published row (computed once a row)."""
    key = json.dumps(row, sort_keys=True)
    if key not in _CASES:
        _CASES[key] = _case(row)
    return _CASES[key]


def _case(row: dict):
    from advisor.config import Checkpointing, Precision, Strategy
    from advisor.hardware import get_hardware
    from advisor.parallel.layout import Layout, PipelineSchedule
    from advisor.workload import DecoderArch

    n, tp, pp, cp, vp = row["num_gpus"], row["tp"] or 1, row["pp"] or 1, row["cp"] or 1, row["vp"] or 1
    dp = n // (tp * pp * cp)
    mbs, gbs = row["mbs"], row["gbs"]
    m = gbs // (dp * mbs)
    arch = DecoderArch(layers=row["layers"], hidden=row["hidden"], heads=row["heads"],
                       kv_heads=row["kv_heads"] or row["heads"], ffn_hidden=row["ffn"], vocab=row["vocab"],
                       seq_len=row["seq_len"], **family(row["model"]))
    fsdp = "megatron" not in (row.get("kernels") or "").lower()  # AutoModel (FSDP2), MaxText and PaxML shard
    strategy = (Strategy.zero3 if fsdp else Strategy.ddp) if dp * cp > 1 else Strategy.single
    # Layout.model_construct: Megatron's tp with a data-parallel all-reduce is a configuration the advisor's own
    # program does not run (it needs FSDP2 under tp), but its step is priced the same way
    layout = Layout.model_construct(dp=dp, tp=tp, pp=pp, cp=cp, dp_replicate=1, strategy=strategy,
                                    schedule=PipelineSchedule.interleaved_1f1b if pp > 1 and vp > 1
                                    else PipelineSchedule.one_f_one_b,
                                    microbatches=m if pp > 1 else None, virtual_stages=vp if pp > 1 else 1,
                                    stage_layers=None, sequence_parallel=True)
    per_node = min(n, 8)
    hw = get_hardware(f"h100-sxm:{per_node}x{n // per_node}")
    knobs = {"micro_batch_size": mbs, "grad_accum": 1 if pp > 1 else m, "precision": Precision.bf16_pure,
             "checkpointing": Checkpointing.full if str(row.get("act_ckpt")).lower() == "true"
             else Checkpointing.none}
    if row.get("act_ckpt") is None and "maxtext" in (row.get("kernels") or "").lower():
        # the source does not say: MaxText's default (base.yml, remat_policy 'full'); Megatron-Core's and
        # AutoModel's is no recompute
        knobs["checkpointing"] = Checkpointing.full
    return arch, hw, layout, knobs


_PREDICTED: dict[str, dict] = {}


def predict(row: dict) -> dict:
    """The row's step time as predicted from its configuration (computed once a row: the plan-quality check asks
    again for each model, GPU count and batch)."""
    key = json.dumps(row, sort_keys=True)
    if key not in _PREDICTED:
        _PREDICTED[key] = _predict(row)
    return _PREDICTED[key]


def _predict(row: dict) -> dict:
    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.roofline import peak_flops
    from advisor.plan.steptime import predict_step

    arch, hw, layout, knobs = case(row)
    st = predict_step(arch, hw, layout, optimizer=OptimizerKind.adamw, **knobs)
    tokens = row["gbs"] * row["seq_len"]
    rule = 6 * row["params_b"] * 1e9 * tokens / (0.5 * peak_flops(hw, Precision.bf16) * row["num_gpus"])
    return {"model": row["model"], "version": row["version"], "gpus": row["num_gpus"],
            "config": f"tp{layout.tp} pp{layout.pp} cp{layout.cp} vp{layout.virtual_stages} dp{layout.dp} "
                      f"mbs{row['mbs']} gbs{row['gbs']}" + (" fsdp" if (row.get("fsdp") or 1) > 1 else "")
                      + f" ckpt {knobs['checkpointing'].value}" + ("" if row.get("act_ckpt") is not None else "?"),
            "published_s": row["step_time_s"], "predicted_s": st.step_time_s, "rule_s": rule,
            "error": st.step_time_s / row["step_time_s"] - 1, "rule_error": rule / row["step_time_s"] - 1,
            "breakdown": st.breakdown.model_dump()}


def plan_quality(judged: list[dict]) -> list[dict]:
    """For each published model, GPU count and batch: the planner's top plan against the published mesh run by the
    advisor's program, both in pure bf16 (as the rows are predicted: Megatron's BF16 keeps bf16 parameters and
    activations), and where they differ, the part of the step that the top plan saves most on."""
    from advisor.errors import SpecError
    from advisor.plan.knobs import FixedKnobs
    from advisor.plan.model import PlanRequest
    from advisor.plan.search import plan

    out, seen = [], set()
    for row in judged:
        arch, hw, layout, knobs = case(row)
        key = (json.dumps(arch.model_dump(), sort_keys=True), row["num_gpus"], row["gbs"])
        if key in seen:
            continue
        seen.add(key)
        target = f"h100-sxm:{hw.devices_per_node}x{hw.nodes}"
        pure = FixedKnobs(precision=knobs["precision"])
        top = plan(PlanRequest(arch=arch, hardware=[target], global_batch_size=row["gbs"], top=1,
                               fixed=pure)).plans[0]
        mesh = pure.model_copy(update=dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                                           virtual_stages=layout.virtual_stages, micro_batch_size=row["mbs"],
                                           checkpointing=knobs["checkpointing"]))
        try:
            theirs = plan(PlanRequest(arch=arch, hardware=[target], global_batch_size=row["gbs"], top=1, fixed=mesh))
            pub, why = (theirs.plans[0] if theirs.plans and theirs.fits else None), None
        except SpecError as exc:  # a mesh the advisor's program does not run (uneven pipeline stages, say)
            pub, why = None, str(exc)
        # the same model, GPU count and batch may be published more than once: the fastest run is the bar
        fastest = min((r for r in judged if case(r)[0] == arch and r["num_gpus"] == row["num_gpus"]
                       and r["gbs"] == row["gbs"]), key=lambda r: r["step_time_s"])
        # the published configuration as its own framework ran it, priced by the same step-time model (its memory
        # is that framework's, not the advisor's program's): the bar for every row, the mesh fitting here or not
        priced = max(row["gbs"] * row["seq_len"] / (predict(r)["predicted_s"] * row["num_gpus"]) for r in judged
                     if case(r)[0] == arch and r["num_gpus"] == row["num_gpus"] and r["gbs"] == row["gbs"])
        entry = {"model": row["model"], "gpus": row["num_gpus"], "gbs": row["gbs"], "top": top.config.label(),
                 "top_mbs": top.config.micro_batch_size, "top_ckpt": top.config.checkpointing.value,
                 "top_fits": top.fits, "top_tokens_per_s_per_device": top.tokens_per_s_per_device,
                 "published": f"dp{layout.dp} tp{layout.tp} pp{layout.pp} cp{layout.cp} v{layout.virtual_stages} "
                              f"mbs{row['mbs']} ckpt {knobs['checkpointing'].value}",
                 "published_fits": pub is not None, "published_not_run": why,
                 "published_measured_tokens_per_s_per_device": row["gbs"] * row["seq_len"]
                 / (fastest["step_time_s"] * row["num_gpus"]),
                 "published_tokens_per_s_per_device": pub.tokens_per_s_per_device if pub else None,
                 "published_priced_tokens_per_s_per_device": priced,
                 "at_least_priced": top.fits and top.tokens_per_s_per_device >= priced * (1 - 1e-9)}
        if pub is not None:
            saved = {k: getattr(pub.breakdown, k) - getattr(top.breakdown, k)
                     for k in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")}
            entry["saves_most_on"] = max(saved, key=saved.get)
            entry["at_least_published"] = top.tokens_per_s_per_device >= pub.tokens_per_s_per_device * (1 - 1e-9)
        out.append(entry)
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def summary(results: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in results]
    rule = [abs(r["rule_error"]) for r in results]
    by_model: dict[str, dict[str, tuple[float, float]]] = {}
    for r in results:  # a model's distinct configurations, tokens/s per GPU published and predicted
        key = re.sub(r"\s+\d-node$", "", r["model"])
        tps = r["gpus"] and 1 / r["published_s"] / r["gpus"]
        by_model.setdefault(key, {})[f"{r['gpus']} {r['config']}"] = (tps, 1 / r["predicted_s"] / r["gpus"])
    rho = {m: spearman([a for a, _ in v.values()], [b for _, b in v.values()])
           for m, v in by_model.items() if len(v) >= 3}
    return {"rows": len(results), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
            "rule_median_abs_error": statistics.median(rule), "rule_max_abs_error": max(rule), "spearman": rho}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan-accuracy.json")
    ap.add_argument("--fit", action="store_true", help="search the compute efficiencies on half the rows")
    args = ap.parse_args()
    rows = [json.loads(line) for line in PUBLISHED.read_text().splitlines() if line.strip()]
    judged, left_out = [], {}
    for row in rows:
        why = excluded(row)
        if why:
            left_out[why] = left_out.get(why, 0) + 1
        else:
            judged.append(row)
    judged.sort(key=lambda r: (r["model"], r["num_gpus"], r["tp"] or 1, r["pp"] or 1, r["cp"] or 1, r["version"]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    report: dict = {"meta": {"command": "bench/plan_accuracy.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
                             "date": time.strftime("%Y-%m-%d")}, "left_out": left_out}
    if args.fit:
        report["fit"] = fit(judged[0::2])
    results = [predict(r) for r in judged]
    report |= {"all": summary(results), "fit_half": summary(results[0::2]), "check_half": summary(results[1::2]),
               "results": results, "plans": plan_quality(judged)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)


def markdown(report: dict) -> str:
    """The results page's section: the summary beside the rule's, each model's order, every configuration."""
    m, a = report["meta"], report["all"]
    fitted = report.get("fit")
    lines = [f"`{m['command']}` on {m['commit']}, {m['date']} (a model against published figures: no device runs).",
             "", "| rows | median / max \\|error\\| | goal | met | 6ND rule at half the peak, same rows |",
             "|---|---|---|---|---|"]
    for name, key in (("all", "all"), ("fit half", "fit_half"), ("held-out half", "check_half")):
        s = report[key]
        met = "yes" if s["median_abs_error"] <= 0.10 and s["max_abs_error"] <= 0.25 else "NO"
        lines.append(f"| {name}: {s['rows']} | {s['median_abs_error']:.1%} / {s['max_abs_error']:.1%} | ≤ 10% / ≤ 25% "
                     f"| {met} | {s['rule_median_abs_error']:.1%} / {s['rule_max_abs_error']:.1%} |")
    lines += ["", ("Efficiencies fitted on the fit half: matmul {matmul_efficiency}, attention {attention_efficiency} "
                   "(median error there {median_abs_error:.1%}).").format(**fitted) if fitted else
              "Efficiencies as advisor/plan/steptime.py sets them (no fit in this run).", "",
              "Each model's configurations ordered by tokens/s per GPU, predicted against published (Spearman; goal "
              "≥ 0.8): " + ", ".join(f"{k} {v:.2f}" for k, v in a["spearman"].items()) + ".", "",
              "Left out: " + "; ".join(f"{why} ({n} rows)" for why, n in sorted(report["left_out"].items())) + "."]
    plans = report["plans"]
    compared = [p for p in plans if p["published_tokens_per_s_per_device"] is not None]
    good = sum(bool(p["top_fits"] and p.get("at_least_published")) for p in compared)
    measured = sum(bool(p["top_fits"] and p["top_tokens_per_s_per_device"]
                        >= p["published_measured_tokens_per_s_per_device"]) for p in plans)
    priced = sum(bool(p.get("at_least_priced")) for p in plans)
    near = sum(bool(p["top_fits"] and p["top_tokens_per_s_per_device"]
                    >= 0.99 * p["published_priced_tokens_per_s_per_device"]) for p in plans)
    lines += ["", " ".join([
        f"Plan quality (goal: every one): of {len(plans)} published models and GPU counts, the planner's top plan fits",
        "with a predicted throughput at least that of the published configuration, as the same step-time model prices",
        f"it, for {priced}, and within 1% of it for {near} (the published configuration as its framework ran it: its",
        "memory is that framework's; Megatron-LM's distributed optimizer is priced as DDP's all-reduce).",
        f"The published mesh run by the advisor's program fits for {len(compared)}, and for {good} of those the top",
        "plan's predicted throughput is at least the mesh's (both in pure bf16; the mesh with the planner's choice of",
        "data-parallel strategy). Where the published mesh does not fit, the advisor's program needs more memory than",
        "the published run did (torch's interleaved schedule keeps its sends until the step ends: docs/planner.md),",
        "or the mesh is one it does not run. Against the published runs' measured",
        "throughput (the fastest where a run is published more than once),",
        f"the top plan fits with a predicted throughput at least as high for {measured} of {len(plans)}.",
        "Where the plans differ, the part of the step the top plan saves most on:"]), "",
              "| model | GPUs | batch | published mesh | measured tokens/s/GPU | priced | run by the advisor "
              "| top plan | its tokens/s/GPU | saves most on |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        theirs = p["published_tokens_per_s_per_device"]
        faster = theirs and p["top_tokens_per_s_per_device"] > theirs * 1.001
        saves = p.get("saves_most_on", "-").removesuffix("_s").replace("_", " ") if faster else "-"
        shown = f"{theirs:,.0f}" if theirs else (f"not run here: {p['published_not_run']}" if p["published_not_run"]
                                                 else "does not fit")
        lines.append(f"| {p['model']} | {p['gpus']} | {p['gbs']} | {p['published']} "
                     f"| {p['published_measured_tokens_per_s_per_device']:,.0f} "
                     f"| {p['published_priced_tokens_per_s_per_device']:,.0f} | {shown} | {p['top']} mbs "
                     f"{p['top_mbs']} ckpt {p['top_ckpt']}" + ("" if p["top_fits"] else " (does not fit)")
                     + f" | {p['top_tokens_per_s_per_device']:,.0f} | {saves} |")
    lines += ["", "| model | GPUs | configuration (`?`: recompute the source does not state) | published s "
              "| predicted s | error | 6ND rule |", "|---|---|---|---|---|---|---|"]
    seen: dict[tuple, list[dict]] = {}
    for r in report["results"]:
        seen.setdefault((r["model"], r["gpus"], r["config"]), []).append(r)
    for (model, gpus, config), rs in seen.items():
        pub = sorted(r["published_s"] for r in rs)
        shown = f"{pub[0]:.2f}" if pub[0] == pub[-1] else f"{pub[0]:.2f}-{pub[-1]:.2f}"
        errs = sorted(r["error"] for r in rs)
        err = f"{errs[0]:+.1%}" if len(rs) == 1 else f"{errs[0]:+.1%} to {errs[-1]:+.1%}"
        rule = max((r["rule_error"] for r in rs), key=abs)
        lines.append(f"| {model} | {gpus} | {config} | {shown} | {rs[0]['predicted_s']:.2f} | {err} | {rule:+.1%} |")
    return "\n".join(lines) + "\n"


def fit(rows: list[dict]) -> dict:
    """The matmul and attention efficiencies (a grid, 0.01 apart) with the least median error on `rows`."""
    import advisor.plan.steptime as steptime

    best = None
    for mm in [x / 100 for x in range(50, 86)]:
        for attn in [x / 100 for x in range(15, 71, 5)]:
            steptime.MATMUL_EFFICIENCY, steptime.ATTENTION_EFFICIENCY = mm, attn
            # the efficiencies vary here: each prediction is made afresh, never predict's cached one
            err = statistics.median(abs(_predict(r)["error"]) for r in rows)
            if best is None or err < best[0]:
                best = (err, mm, attn)
    steptime.MATMUL_EFFICIENCY, steptime.ATTENTION_EFFICIENCY = best[1], best[2]
    return {"median_abs_error": best[0], "matmul_efficiency": best[1], "attention_efficiency": best[2]}


if __name__ == "__main__":
    main()
