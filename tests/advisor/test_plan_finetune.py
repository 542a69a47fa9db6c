"""The planner with a fine-tune (advisor/plan/tuning.py, advisor/estimate/parallel_tuned.py): frozen parts and LoRA
adapters in the analytic memory against the traced estimator, gradients and optimizer state that scale with the
adapters, the step a LoRA plan saves, the data-parallel layouts it plans, and one-line refusals over the CLI and
the API."""

from __future__ import annotations

import json

import pytest
from plan_cli import advisor

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import SpecError
from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
from advisor.estimate.parallel_analytic import analytic_rank, rank_memory
from advisor.estimate.parallel_moments import StepKnobs
from advisor.estimate.trace import trace_training
from advisor.finetune import FineTune, LoraSpec, with_finetune
from advisor.hardware import get_hardware
from advisor.parallel.layout import Layout
from advisor.plan.search import PlanRequest, plan
from advisor.plan.steptime import predict_step
from advisor.plan.tuning import tuning_of
from advisor.presets import get_preset
from advisor.workload import DecoderArch, load_workload

# a small Llama-shaped decoder (GQA, SwiGLU, RMSNorm) wide enough that per-tensor rounding is not what is compared
SHAPE = dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024, seq_len=64)
LORA = FineTune(lora=LoraSpec(r=16, alpha=32, targets=("wq", "wv")))
LORA_8B = FineTune(lora=LoraSpec(r=16, alpha=32, targets=("wq", "wv")))
FREEZE = FineTune(freeze=("tok_embeddings", "blocks.0.*", "blocks.1.*"))
BATCH = 4
LORA_DROPOUT = FineTune(lora=LoraSpec(r=16, alpha=32, dropout=0.1, targets=("wq", "wv", "w2")))
# The analytic model's peak against the traced one of the same single-device step: the rank's tensors, counted one
# by one, as tests/advisor/test_parallel_analytic.py holds full training to 3% of real ranks' traces. Here the
# step's peak is the loss's (frozen base, activations, logits), whose tensors the formulas count exactly but for a
# few scalars; 1% leaves room for those.
TOLERANCE = 0.01


def adapter_params(arch: DecoderArch, r: int) -> int:
    """Elements of LoRA adapters on wq and wv of every block: A r x hidden, B out x r."""
    kv = arch.kv_heads * (arch.hidden // arch.heads)
    return arch.layers * r * (2 * arch.hidden + arch.hidden + kv)


def traced_peak(spec: FineTune | None, precision: Precision) -> int:
    """The traced estimator's peak of live tensor bytes for one H100 (its parts, overhead aside), less the cuBLAS
    workspaces it places on the device and the analytic rank leaves to the device's share (cuda_alloc.py)."""
    from advisor.estimate.cuda_alloc import cublas_workspace_bytes

    est = estimate_memory("decoder", "h100-sxm", EstimateRequest(batch_size=BATCH, precision=precision),
                          EstimateOptions(calibrate=False, measured=False),
                          workload_args=with_finetune(SHAPE, spec))
    b = est.breakdown
    return b.parameters + b.gradients + b.optimizer_state + b.activations + b.temporaries - \
        cublas_workspace_bytes("h100-sxm")


def analytic_peak(spec: FineTune | None, precision: Precision, device_type: str = "cuda") -> int:
    arch = get_preset("decoder")(**SHAPE).decoder
    parts, _ = analytic_rank(arch, Layout(), 0, BATCH, precision=precision, optimizer=OptimizerKind.adamw,
                             optimizer_impl="foreach", device_type=device_type, tuning=tuning_of(spec, arch))
    return sum(parts.values())


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
@pytest.mark.parametrize("spec", [LORA, FREEZE], ids=["lora", "freeze"])
def test_the_analytic_fine_tune_agrees_with_the_traced_estimate_on_one_device(spec: FineTune, precision: Precision):
    analytic, traced = analytic_peak(spec, precision), traced_peak(spec, precision)
    assert abs(analytic - traced) <= TOLERANCE * traced, (analytic, traced)
    # and it counts the fine-tune: less than full training's, by about what the trace saves
    full_analytic, full_traced = analytic_peak(None, precision), traced_peak(None, precision)
    assert analytic < full_analytic
    assert (full_analytic - analytic) == pytest.approx(full_traced - traced, rel=0.02)


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_adapter_dropout_keeps_its_masks_and_outputs(precision: Precision):
    """CUDA's fused dropout keeps a 1-byte mask per element (the trace for an H100 runs it,
    estimate/dropout_cuda.py); a CPU's keeps the noise it scales by in the input's dtype (peft's fp32), 3 bytes
    more. A mask is kept where the dropout's input needs a gradient: the wq, wv and w2 inputs of every block but
    the first, whose wq and wv read the frozen embedding's output, so only its w2 input does."""
    with_dropout, without = analytic_peak(LORA_DROPOUT, precision), analytic_peak(LORA, precision)
    traced = traced_peak(LORA_DROPOUT, precision)
    masks = BATCH * SHAPE["seq_len"] * ((SHAPE["layers"] - 1) * (2 * SHAPE["hidden"] + SHAPE["ffn"]) + SHAPE["ffn"])
    assert with_dropout > without
    assert abs(with_dropout - traced) <= TOLERANCE * traced, (with_dropout, traced)
    assert analytic_peak(LORA_DROPOUT, precision, "cpu") - with_dropout == 3 * masks
    # and a CPU's own trace adds what the analytic CPU rank adds
    kw = dict(precision=precision, optimizer=OptimizerKind.adamw, optimizer_impl="foreach", count_flops=False)
    cpu = [trace_training(load_workload("decoder", with_finetune(SHAPE, spec)), BATCH, **kw).peak_bytes
           for spec in (LORA_DROPOUT, LORA)]
    assert cpu[0] - cpu[1] == analytic_peak(LORA_DROPOUT, precision, "cpu") - without


def test_lora_gradients_and_optimizer_state_scale_with_the_adapters_not_the_base():
    arch = get_preset("llama-8b")(seq_len=512).decoder
    adapters = adapter_params(arch, 16)

    def at_rest(spec: FineTune | None, layout: Layout = Layout()) -> tuple[tuple[int, int, int], dict[str, int]]:
        mem, comm = rank_memory(arch, layout, 0, 1, precision=Precision.bf16, optimizer=OptimizerKind.adamw,
                                checkpointing=Checkpointing.none, optimizer_impl="fused", device_type="cuda",
                                knobs=StepKnobs(), tuning=tuning_of(spec, arch))
        return mem.at_rest, comm

    (full_params, full_grads, full_state), _ = at_rest(None)
    (params, grads, state), _ = at_rest(LORA_8B)
    assert state < 0.01 * full_state and grads < 0.01 * full_grads
    # the adapters' fp32 gradients and AdamW's two moments, and a step counter per adapter tensor
    assert grads == 4 * adapters and state == 8 * adapters + 4 * (4 * arch.layers)
    # the base held in bf16 under bf16 (advisor.finetune.hold_frozen), the adapters in fp32
    assert params == 2 * (full_params // 4) + 4 * adapters
    # data parallel reduces the adapters' gradients only; FSDP still gathers the whole base
    _, ddp = at_rest(LORA_8B, Layout(dp=2, strategy=Strategy.ddp))
    assert ddp == {"all_reduce": 4 * adapters}
    _, fsdp = at_rest(LORA_8B, Layout(dp=2, strategy=Strategy.zero3))
    assert fsdp["reduce_scatter"] <= 4 * adapters + 4096 and fsdp["all_gather"] > full_params // 2


def test_hugging_face_names_map_to_the_decoders_linears():
    llama = get_preset("llama-8b")().decoder
    hf = tuning_of(FineTune(lora=LoraSpec(r=8, targets=("q_proj", "v_proj"))), llama, "llama")
    assert hf == tuning_of(FineTune(lora=LoraSpec(r=8, targets=("wq", "wv"))), llama)
    gpt2 = get_preset("gpt2-small")().decoder
    fused = tuning_of(FineTune(lora=LoraSpec(r=8, targets=("c_attn", "lm_head"))), gpt2, "gpt2")
    assert fused.adapters[0] == (("wq", "wk", "wv"),) and fused.head_adapter
    frozen = tuning_of(FineTune(freeze=("model.layers.[0-9].*", "model.embed_tokens")), llama, "llama")
    assert [bool(f) for f in frozen.frozen] == [True] * 10 + [False] * (llama.layers - 10)
    assert "tok_embeddings" in frozen.frozen_root and "output" not in frozen.frozen_root



def test_a_lora_plan_fits_one_l4_where_full_training_does_not():
    base = ["plan", "-w", "llama-8b", "-a", "seq_len=512", "-H", "l4:1", "--json"]
    proc = advisor(*base, "--lora", "r=16,alpha=32", "--lora-targets", "wq,wv")
    assert proc.returncode == 0, proc.stderr
    lora = json.loads(proc.stdout)
    assert lora["fits"] and lora["workload"] == "llama-8b+lora"
    best = lora["plans"][0]
    assert best["fits"] and best["memory"]["optimizer_state"] < 2**27  # the adapters' moments, not the base's
    assert any("planned data parallel only" in note for note in lora["notes"])
    full = json.loads(advisor(*base).stdout)
    assert not full["fits"]


def test_a_lora_step_is_faster_than_full_training_on_the_same_layout():
    arch = get_preset("llama-8b")().decoder
    hw = get_hardware("h100-sxm:8")
    layout = Layout(dp=8, strategy=Strategy.zero2)

    def step(spec: FineTune | None):
        return predict_step(arch, hw, layout, micro_batch_size=1, grad_accum=8, precision=Precision.bf16,
                            checkpointing=Checkpointing.none, optimizer=OptimizerKind.adamw,
                            tuning=tuning_of(spec, arch))

    full, lora = step(None), step(LORA_8B)
    assert lora.step_time_s < full.step_time_s
    # backward skips the frozen weights' gradients: about a third of the products' time, less the adapters'
    assert lora.breakdown.compute_s < 0.8 * full.breakdown.compute_s
    assert lora.breakdown.optimizer_s < 0.01 * full.breakdown.optimizer_s + 1e-4
    assert lora.breakdown.comm_s["dp"] < full.breakdown.comm_s["dp"]  # the base's gathers, no base reduction


def test_a_fine_tune_is_planned_data_parallel_and_a_held_layout_is_refused():
    result = plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"], finetune=LORA_8B, top=5))
    assert result.fits and result.workload == "llama-8b+lora"
    assert all((p.config.tp, p.config.pp, p.config.cp, p.config.dp_replicate) == (1, 1, 1, 1) for p in result.plans)
    from advisor.plan.knobs import parse_fixes

    with pytest.raises(SpecError, match="tp=2 with a fine-tune"):
        plan(PlanRequest(workload="llama-8b", hardware=["h100-sxm:8"], finetune=LORA_8B, fixed=parse_fixes(["tp=2"])))


def test_recommend_plans_the_fine_tune_its_workload_args_carry():
    from advisor.plan.recommend import plans_for, training_config
    from advisor.workload import load_workload

    args = with_finetune({}, LORA_8B)
    result = plans_for(load_workload("llama-8b", args), "h100-sxm:8", "llama-8b", args)
    assert result.fits and result.workload == "decoder+lora"
    config = training_config(result.plans[0].config)
    assert config.nproc == 8 and (config.tp, config.pp, config.cp) == (1, 1, 1)


@pytest.mark.parametrize("args, says", [
    (["--lora", "r=16", "--lora-targets", "qq_proj"], "LoRA target 'qq_proj' matches no Linear of llama-8b; the "
     "planner counts adapters on its Linears: wq, wk, wv, wo, w1, w3, w2, output"),
    (["--lora", "r=16", "--lora-targets", "attn_norm"], "LoRA target 'attn_norm' is not a Linear"),
    # a preset's model has the advisor's names, as its trial does; Hugging Face's are an hf: config's
    (["--lora", "r=16", "--lora-targets", "q_proj"], "LoRA target 'q_proj' matches no Linear of llama-8b; the "
     "planner counts adapters on its Linears: wq, wk, wv, wo, w1, w3, w2, output"),
    (["--freeze", "layers.0.*"], "freeze pattern 'layers.0.*' matches no module of llama-8b"),
    (["--lora", "r=16", "--lora-targets", "wq", "--fix", "tp=2"], "tp=2 with a fine-tune: its trial runs"),
])
def test_bad_fine_tunes_are_one_line_and_exit_2(args: list[str], says: str):
    proc = advisor("plan", "-w", "llama-8b", "-H", "h100-sxm:8", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_the_api_plans_a_fine_tune_and_refuses_what_it_cannot(sqlite_url):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # starlette's note about httpx's successor
        from fastapi.testclient import TestClient

    from advisor.settings import Settings
    from api.app import create_app

    lora = {"lora": {"r": 16, "alpha": 32, "targets": ["wq", "wv"]}}
    body = {"workload": "llama-8b", "hardware": ["h100-sxm:8"], "top": 2}
    with TestClient(create_app(sqlite_url, settings=Settings(database_url=sqlite_url)),
                    raise_server_exceptions=False) as c:
        r = c.post("/v1/plan", json={**body, "finetune": lora})
        assert r.status_code == 200, r.text
        assert r.json()["workload"] == "llama-8b+lora" and r.json()["plans"]
        assert all(p["config"]["tp"] == 1 for p in r.json()["plans"])
        r = c.post("/v1/plan", json={**body, "finetune": {"lora": {"r": 16, "targets": ["nope"]}}})
        assert r.status_code == 422 and "LoRA target 'nope' matches no Linear" in r.json()["detail"], r.text
        r = c.post("/v1/plan", json={**body, "finetune": lora, "fix": {"pp": 2}})
        assert r.status_code == 422 and "pp=2 with a fine-tune" in r.json()["detail"], r.text
