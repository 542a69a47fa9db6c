"""The tuner's opening moves: screen each knob against the baseline, combine the winners, then TPE.

A small budget leaves TPE a handful of mostly random start-up draws. Training knobs mostly act on
throughput one at a time (bf16 speeds the matmuls whatever the batch; workers feed the step whatever
the precision), so a two-level screen measures them cheaply: from the reference (the baseline, always
measured first) change one knob to its farthest value, one trial per knob, then measure the reference
with every change that beat it. TPE learns from all of those trials and searches the interactions the
screen misses. The reference enters the Optuna study as a finished trial (`add_reference`), so a
resumed study screens from the same point and does not screen a knob twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    from optuna import Study

REFERENCE_ATTR = "advisor_reference"  # user attribute marking the reference trial
ROLE_ATTR = "advisor_screen"  # system attribute: what a screening trial was for ("knob=value" or "combination")
# What PyTorch does with a knob our config leaves unset (None) once a change opens it.
OPENED_DEFAULTS = {"prefetch_factor": 2}  # DataLoader's default with workers
# The order knobs are screened in when the budget cannot screen them all: what usually moves
# training throughput most first (precision, batch, compile, the input pipeline, then the rest).
IMPACT = ("precision", "batch_size", "compile_mode", "num_workers", "strategy", "tp", "pp", "threads", "channels_last",
          "optimizer_impl", "fused_backward", "checkpointing", "pin_memory", "prefetch_factor",
          "persistent_workers", "pinning", "optimizer", "grad_accum", "cpu_list")


def farthest(distribution: BaseDistribution, value: Any) -> Any:
    """The value of `distribution` farthest from `value` in the domain's order (the screen's other
    level), or None if the domain holds nothing else. Choices are ordered as the space lists them."""
    if isinstance(distribution, CategoricalDistribution):
        choices = list(distribution.choices)
        if value not in choices or len(choices) < 2:
            return None
        i = choices.index(value)
        return choices[-1] if len(choices) - 1 - i >= i else choices[0]
    if isinstance(distribution, IntDistribution):
        if distribution.low == distribution.high:
            return None
        return distribution.high if distribution.high - value >= value - distribution.low else distribution.low
    return None


class ScreeningSampler(BaseSampler):
    """Two-level screen from the reference trial, one combination of the winners, then `base`.

    `max_screens` caps the screening trials (the driver gives it about half the budget): knobs
    are screened in IMPACT order, the rest left to `base`. Single-objective (maximize) only.
    """

    def __init__(self, base: BaseSampler, max_screens: int) -> None:
        self._base = base
        self._max_screens = max(0, max_screens)
        self._targets: dict[int, dict[str, Any]] = {}  # trial number -> the params this trial is to take

    # -- what to measure next ----------------------------------------------------------------

    @staticmethod
    def _reference(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
        return next((t for t in trials if t.user_attrs.get(REFERENCE_ATTR) and t.state == TrialState.COMPLETE), None)

    def _screens(self, ref: FrozenTrial) -> list[tuple[str, Any]]:
        """(knob, other level) for each knob of the reference that has another value, IMPACT order."""
        rank = {k: i for i, k in enumerate(IMPACT)}
        knobs = sorted(ref.params, key=lambda k: (rank.get(k, len(rank)), k))
        out = []
        for knob in knobs:
            other = farthest(ref.distributions[knob], ref.params[knob])
            if other is not None:
                out.append((knob, other))
        return out[: self._max_screens]

    def plan(self, study: "Study", number: int) -> tuple[str, dict[str, Any]] | None:
        """(role, params) for trial `number`: the next unscreened knob, else the combination of the
        winners once every screen has finished, else None (the base sampler decides)."""
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != number]
        ref = self._reference(trials)
        if ref is None or not self._max_screens:
            return None
        live = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)]
        roles = {t.system_attrs.get(ROLE_ATTR) for t in trials}  # a failed screen is not tried again
        screens = self._screens(ref)
        for knob, other in screens:
            role = f"{knob}={other!r}"
            if role not in roles and not any(_matches(t.params, {**ref.params, knob: other}) for t in live):
                return role, {**ref.params, knob: other}
        if "combination" in roles or any(t.state != TrialState.COMPLETE for t in live if t.system_attrs.get(ROLE_ATTR)):
            return None  # combined already, or a screen still running: its verdict is not in yet
        base_value = ref.values[0]
        winners: dict[str, Any] = {}
        for knob, other in screens:
            changed = {**ref.params, knob: other}
            done = [t for t in live if t.state == TrialState.COMPLETE and _matches(t.params, changed)]
            if done and done[0].values and done[0].values[0] > base_value:
                winners[knob] = other
        if len(winners) < 2:  # none or one: nothing new to combine (that one is measured)
            return None
        combined = {**ref.params, **winners}
        if any(_matches(t.params, combined) for t in live):
            return None
        return "combination", combined

    # -- Optuna's sampler interface ----------------------------------------------------------

    def before_trial(self, study: "Study", trial: FrozenTrial) -> None:
        planned = self.plan(study, trial.number)
        if planned is not None:
            role, params = planned
            self._targets[trial.number] = params
            study._storage.set_trial_system_attr(trial._trial_id, ROLE_ATTR, role)
        self._base.before_trial(study, trial)

    def infer_relative_search_space(self, study: "Study", trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if trial.number in self._targets:
            return {}
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(self, study: "Study", trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial.number in self._targets:
            return {}
        return self._base.sample_relative(study, trial, search_space)

    def sample_independent(self, study: "Study", trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        from search_spaces.layout import knob_of

        target = self._targets.get(trial.number)
        if target is not None:
            knob = knob_of(param_name)  # a knob asked under a name listing the values left (`pp[1,2]`)
            if knob in target and contains(param_distribution, target[knob]):
                return target[knob]
            default = _config_default(knob)
            if default is not None and contains(param_distribution, default):
                return default  # a knob the change opened (prefetch once workers exist): PyTorch's default
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: "Study", trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._targets.pop(trial.number, None)
        self._base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()


def _matches(params: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a trial took `wanted`: knobs only one side reached (a condition opened them) are not
    compared, as the knobs that decide those conditions are."""
    return all(params[k] == v for k, v in wanted.items() if k in params)


def contains(distribution: BaseDistribution, value: Any) -> bool:
    try:
        return distribution._contains(distribution.to_internal_repr(value))
    except (ValueError, TypeError):
        return False


def _config_default(knob: str) -> Any:
    from advisor.trial import TrainingConfig

    if knob in OPENED_DEFAULTS:
        return OPENED_DEFAULTS[knob]
    field = TrainingConfig.model_fields.get(knob)
    if field is None or field.default is None:
        return None
    default = field.default
    return getattr(default, "value", default)  # enums are suggested by their values


def add_reference(study: "optuna.Study", params: dict[str, Any], distributions: dict[str, BaseDistribution],
                  values: list[float]) -> bool:
    """Put the measured reference (the baseline) into the Optuna study as a finished trial, once:
    samplers learn from it and the screen starts from it. False if it is there already."""
    if any(t.user_attrs.get(REFERENCE_ATTR) for t in study.get_trials(deepcopy=False)):
        return False
    study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, values=values,
                                              user_attrs={REFERENCE_ATTR: True}))
    return True


__all__ = ["IMPACT", "ScreeningSampler", "add_reference", "contains", "farthest"]
