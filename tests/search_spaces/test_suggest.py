"""`suggest` through a real Optuna study (define-by-run): only valid configurations, and a
conditional knob is a parameter of a trial exactly when its condition holds."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution

from search_spaces import get_space, load_space, suggest

from space_checks import violations

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _ask_all(space, ctx, n, sampler=None):
    study = optuna.create_study(direction="maximize", sampler=sampler)
    out = []
    for _ in range(n):
        trial = study.ask()
        config = suggest(space, trial, ctx)
        out.append((trial, config))
        # Telling every trial makes later draws consult earlier ones (and their distributions).
        study.tell(trial, float(config.batch_size) if config is not None else None,
                   state=None if config is not None else optuna.trial.TrialState.PRUNED)
    return study, out


@pytest.mark.parametrize("target", ["cpu_ctx", "gpu_ctx"])
def test_suggested_configs_are_valid_and_conditional_params_follow_conditions(target, request):
    ctx = request.getfixturevalue(target)
    _, draws = _ask_all(get_space("default"), ctx, 60, optuna.samplers.RandomSampler(seed=1))
    assert all(config is not None for _, config in draws)
    for trial, c in draws:
        assert not violations(c, ctx), (c, violations(c, ctx))
        params = trial.params
        assert ("prefetch_factor" in params) == (c.num_workers >= 1)
        assert ("fused_backward" in params) == (c.strategy.value == "single" and c.precision.value != "fp16")
        assert "persistent_workers" not in params  # fixed: never searched, set by its condition
        assert "nproc" not in params and "grad_accum" not in params
        for knob, value in params.items():  # what Optuna recorded is what the trial runs
            field = getattr(c, knob)
            assert (field.value if hasattr(field, "value") else field) == value
    if ctx.device == "cpu":  # one value left on the CPU: not a parameter at all
        assert not any({"strategy", "pin_memory"} & set(t.params) for t, _ in draws)
    else:
        assert {t.params["strategy"] for t, _ in draws} == {"single", "ddp", "zero2", "zero3"}
        assert any("prefetch_factor" in t.params for t, _ in draws)
        assert any("prefetch_factor" not in t.params for t, _ in draws)


def test_the_default_sampler_and_distributions(gpu_ctx):
    study, draws = _ask_all(get_space("quick"), gpu_ctx, 15)  # create_study's default sampler (TPE)
    assert all(c is not None and not violations(c, gpu_ctx) for _, c in draws)
    dist = study.trials[0].distributions
    assert dist["batch_size"] == CategoricalDistribution([2, 4, 8, 16, 32, 64])
    assert dist["precision"] == CategoricalDistribution(["fp32", "bf16", "fp16"])
    assert len(study.trials) == 15 and all(t.state.is_finished() for t in study.trials)


def test_an_int_range_is_an_optuna_int_parameter(tmp_path, cpu_ctx):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nknobs:\n  num_workers: {low: 0, high: 8, step: 2}\n"
                    "  batch_size: {low: 4, high: 256, log: true}\n")
    study, draws = _ask_all(load_space(str(path)), cpu_ctx, 20, optuna.samplers.RandomSampler(seed=0))
    dists = study.trials[0].distributions
    assert dists["num_workers"] == IntDistribution(0, 8, step=2)
    assert dists["batch_size"] == IntDistribution(4, 256, log=True)
    assert {c.num_workers for _, c in draws} <= {0, 2, 4, 6, 8}
    assert all(4 <= c.batch_size <= 256 for _, c in draws)


def test_a_global_batch_ddp_cannot_reach_returns_none(gpu_ctx):
    ctx = gpu_ctx.model_copy(update={"global_batch_size": 16})
    _, draws = _ask_all(get_space("tiny"), ctx, 40, optuna.samplers.RandomSampler(seed=2))
    skipped = [t for t, c in draws if c is None]
    kept = [c for _, c in draws if c is not None]
    assert skipped and kept
    assert all(t.params["strategy"] == "ddp" for t in skipped)  # 4 or 8 per rank x 8 ranks > 16
    assert all(c.batch_size * c.grad_accum * c.nproc == 16 for c in kept)
