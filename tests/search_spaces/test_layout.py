"""tp, pp and the pipeline knobs in a space: on 4 devices for a small decoder, every draw is a layout that runs
(TrainingConfig and advisor.parallel's checks agree), the grid holds exactly those layouts, and a parameter
whose values the layout narrows is asked under a name of its own, so Optuna's choices never change."""

from __future__ import annotations

import itertools

import optuna
import pytest

from advisor.errors import SpecError
from advisor.hardware import get_hardware
from advisor.parallel.layout import layout_problems
from advisor.trial import TrainingConfig
from advisor.workload import DecoderArch
from search_spaces import SpaceContext, apply_fixes, get_space, grid, load_space, suggest
from search_spaces.layout import knob_of

from space_checks import violations

optuna.logging.set_verbosity(optuna.logging.WARNING)

# 4 query heads and 2 KV heads: tp 4 divides the devices but not the KV heads. 4 layers: pp 4 runs 1f1b, not
# interleaved (8 stages); pp 2 runs both.
ARCH = DecoderArch(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=256, vocab=512, seq_len=32, gated_ffn=True,
                   norm="rmsnorm")


def _ctx(hardware: str, **kw) -> SpaceContext:
    return SpaceContext(hardware=get_hardware(hardware), device_count=4, default_batch_size=8, decoder=ARCH, **kw)


def _draw(space, ctx, n: int, seed: int = 0):
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        config = suggest(space, trial, ctx)  # Optuna raises here if a parameter's choices changed
        study.tell(trial, 1.0 if config is not None else None,
                   state=None if config is not None else optuna.trial.TrialState.PRUNED)
        out.append((trial.params, config))
    return out


@pytest.mark.parametrize("hardware", ["cpu:4", "h100-sxm:4"])
@pytest.mark.parametrize("name", ["default", "exhaustive"])
def test_every_draw_on_4_devices_is_a_layout_that_runs(name, hardware):
    ctx = _ctx(hardware)
    draws = _draw(get_space(name), ctx, 150)
    assert all(c is not None for _, c in draws)  # no draw wasted on a layout that cannot run
    for params, c in draws:
        assert TrainingConfig.model_validate(c.model_dump()) == c
        assert not violations(c, ctx), (c, violations(c, ctx))
        assert not layout_problems(c.layout(), world=c.nproc, decoder=ARCH, batch_size=c.batch_size)
        assert ARCH.heads % c.tp == 0 and ARCH.kv_heads % c.tp == 0 and ARCH.ffn_hidden % c.tp == 0
        if c.pp == 1:
            assert not {"pp_schedule", "microbatches"} & {knob_of(p) for p in params}
        if c.tp * c.pp > 1:
            assert (c.grad_accum, c.compile_mode.value, c.fused_backward) == (1, "none", False)
            assert c.nproc == 4 and (c.strategy.value == "single") == (c.tp * c.pp == 4)
        if c.tp > 1 and c.tp * c.pp < 4:
            assert c.strategy.value in ("zero2", "zero3")
        if c.pp > 1:
            assert c.precision.value != "fp16" and c.batch_size % c.layout().n_microbatches == 0
        for param, value in params.items():  # what Optuna recorded is what the trial runs
            field = getattr(c, knob_of(param))
            assert (field.value if hasattr(field, "value") else field) == value
    layouts = {(c.tp, c.pp) for _, c in draws}
    assert layouts == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}  # tp 4 never: 2 KV heads
    schedules = {(c.pp, c.pp_schedule.value) for _, c in draws if c.pp > 1}
    assert (2, "interleaved-1f1b") in schedules and (4, "interleaved-1f1b") not in schedules
    assert all(c.virtual_stages == (2 if c.pp_schedule.value == "interleaved-1f1b" else 1) for _, c in draws)
    named = {p for params, _ in draws for p in params}
    assert "strategy[zero2,zero3]" in named  # tp 2 with 2 replicas: FSDP2 only


def test_the_grid_holds_exactly_the_layouts_that_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nknobs:\n  tp: {choices: [1, 2, 4]}\n  pp: {choices: [1, 2, 4]}\n"
                    "  pp_schedule: {choices: [gpipe, 1f1b, interleaved-1f1b]}\n"
                    "  microbatches: {choices: [null, 2, 8]}\n"
                    "  strategy: {choices: [single, ddp, zero1, zero2, zero3]}\n  batch_size: {choices: [2, 4, 8]}\n")
    ctx = _ctx("cpu:4")
    got = {_key(c) for c in grid(load_space(str(path)), ctx)}
    # Independently: every combination TrainingConfig takes, whose layout runs the decoder on the 4 devices
    # (nproc: the device count unless single without tp or pp).
    want = set()
    for tp, pp, schedule, mb, strategy, batch in itertools.product(
            (1, 2, 4), (1, 2, 4), ("gpipe", "1f1b", "interleaved-1f1b"), (None, 2, 8),
            ("single", "ddp", "zero1", "zero2", "zero3"), (2, 4, 8)):
        nproc = 1 if strategy == "single" and tp * pp == 1 else 4
        if pp == 1 and (schedule, mb) != ("1f1b", None):
            continue  # the pipeline knobs exist with pp > 1 only
        try:
            c = TrainingConfig(tp=tp, pp=pp, pp_schedule=schedule, microbatches=mb, strategy=strategy,
                               batch_size=batch, nproc=nproc, virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
        except ValueError:
            continue
        if c.tp * c.pp == 1 or not layout_problems(c.layout(), world=4, decoder=ARCH, batch_size=batch):
            want.add(_key(c))
    assert got == want and len(got) > 50


def _key(c: TrainingConfig) -> tuple:
    return (c.tp, c.pp, c.pp_schedule.value, c.microbatches, c.virtual_stages, c.strategy.value, c.batch_size, c.nproc)


def test_a_global_batch_with_tp_or_pp_is_kept_by_accumulating():
    ctx = _ctx("cpu:4", global_batch_size=16)
    configs = grid(apply_fixes(get_space("default"), {"num_workers": 0, "optimizer_impl": "foreach"}), ctx)
    parallel = [c for c in configs if c.tp * c.pp > 1]
    assert parallel and all(not violations(c, ctx) for c in configs)
    assert all(c.batch_size * c.grad_accum * c.layout().dp == 16 for c in parallel)  # dp: the replicas
    assert {c.grad_accum for c in parallel} > {1}  # a tp/pp step accumulates batches as one device's does


def test_a_model_that_is_not_a_decoder_keeps_tp_and_pp_at_1():
    ctx = _ctx("cpu:4").model_copy(update={"decoder": None})
    configs = grid(get_space("default"), ctx)
    assert configs and {(c.tp, c.pp) for c in configs} == {(1, 1)}
    with pytest.raises(SpecError, match="pp needs a decoder"):
        grid(apply_fixes(get_space("default"), {"pp": 2}), ctx)


def test_a_fixed_tp_the_decoder_cannot_take_says_why():
    with pytest.raises(SpecError, match="tp 4 does not divide kv_heads 2"):
        grid(apply_fixes(get_space("default"), {"tp": 4}), _ctx("cpu:4"))


def test_a_knob_fixed_against_tp_and_pp_leaves_only_data_parallel_draws():
    ctx = _ctx("cpu:4")
    configs = grid(apply_fixes(get_space("default"), {"compile_mode": "default", "num_workers": 0}), ctx)
    assert configs and all(c.tp == c.pp == 1 and c.compile_mode.value == "default" for c in configs)


def test_micro_batch_size_is_searched_with_pp_and_splits_the_batch(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nknobs:\n  pp: {choices: [1, 2, 4]}\n  microbatches: {choices: [null, 2]}\n"
                    "  micro_batch_size: {choices: [null, 1, 2, 4]}\n  strategy: {choices: [single, zero2]}\n"
                    "  batch_size: {choices: [2, 4, 6, 8]}\n")
    space, ctx = load_space(str(path)), _ctx("cpu:4")
    got = grid(space, ctx)
    sized = [c for c in got if c.micro_batch_size is not None]
    assert sized and all(c.pp > 1 and c.batch_size % c.micro_batch_size == 0 for c in sized)
    assert all(c.layout().n_microbatches * c.micro_batch_size == c.batch_size for c in sized)
    assert {(c.batch_size, c.micro_batch_size) for c in sized if c.pp == 2} >= {(4, 2), (8, 4), (6, 1)}
    assert all(not violations(c, ctx) for c in got)
    # independently: every combination TrainingConfig takes whose layout runs the decoder on the 4 devices
    want = set()
    for pp, mb, mbs, strategy, batch in itertools.product((1, 2, 4), (None, 2), (None, 1, 2, 4), ("single", "zero2"),
                                                         (2, 4, 6, 8)):
        if pp == 1 and (mb, mbs) != (None, None):
            continue  # the pipeline knobs exist with pp > 1 only
        try:
            c = TrainingConfig(pp=pp, microbatches=mb, micro_batch_size=mbs, strategy=strategy, batch_size=batch,
                               nproc=1 if strategy == "single" and pp == 1 else 4)
        except ValueError:
            continue
        if pp == 1 or not layout_problems(c.layout(), world=4, decoder=ARCH, batch_size=batch):
            want.add((c.pp, c.microbatches, c.micro_batch_size, c.strategy.value, c.batch_size))
    assert {(c.pp, c.microbatches, c.micro_batch_size, c.strategy.value, c.batch_size) for c in got} == want
    for params, c in _draw(space, ctx, 60):  # Optuna's choices stay fixed: narrowed values asked under own names
        assert c is None or not violations(c, ctx)
        if c is not None and c.pp == 1:
            assert "micro_batch_size" not in {knob_of(p) for p in params}

