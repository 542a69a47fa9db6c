"""The tuner's opening moves: screen each knob, and the pairs of knobs known to act together, each from the
best configuration measured so far; then multivariate TPE.

A small budget leaves TPE a handful of mostly random start-up draws. Many training knobs act on
throughput one at a time (workers feed the step whatever the precision), so a two-level screen measures
them cheaply: change one knob to its farthest value, one trial per knob. Each screen starts from the incumbent,
the best of the reference (the baseline, always measured first) and the screens so far, so a change that won
is kept for the next ones: knobs that pay only together are found in turn (on a CPU, threads=1 beside two
DataLoader workers loses under fp32 and wins under bf16). Some act only as a pair: bf16 autocast on a CPU adds a
cast per op, which only torch.compile fuses away, so bf16 alone and compile alone can each lose to fp32 eager
while the pair wins. So each pair of INTERACTIONS is screened too, right after its second knob. Once every
knob and pair is screened, each is tried once more from the incumbent where that has moved since. The order
follows the baseline's bottleneck where it is known (an input-bound step screens the input pipeline first).
TPE (multivariate, so it models knobs jointly) learns from all of it. The reference enters the Optuna study as
a finished trial (`add_reference`), so a resumed study screens from the same point and does not screen a knob
twice.
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
BOTTLENECK_ATTR = "advisor_bottleneck"  # user attribute: the reference's verdict (input-, compute-, overhead-bound)
ROLE_ATTR = "advisor_screen"  # system attribute: what a screening trial was for ("knob=value", "again:knob=value")
# What PyTorch does with a knob our config leaves unset (None) once a change opens it.
OPENED_DEFAULTS = {"prefetch_factor": 2}  # DataLoader's default with workers
# The order knobs are screened in when the budget cannot screen them all: what usually moves
# training throughput most first (precision and compile, which act as a pair, batch, the input
# pipeline, then the rest).
IMPACT = ("precision", "compile_mode", "batch_size", "num_workers", "strategy", "tp", "pp", "threads", "channels_last",
          "optimizer_impl", "fused_backward", "checkpointing", "pin_memory", "prefetch_factor",
          "persistent_workers", "pinning", "optimizer", "grad_accum", "cpu_list")
# Pairs of knobs whose effects on throughput do not add up, screened together after both alone.
# precision x compile_mode: autocast's casts cost a kernel each in eager mode; compile fuses them.
# precision x batch_size: low precision pays off once matmuls are large enough to be compute-bound.
# precision x channels_last: oneDNN's and cuDNN's fast low-precision convolutions want NHWC.
# num_workers x threads: DataLoader workers take cores from the step's intra-op threads.
# compile_mode x checkpointing: compile fuses the recomputed forward, which eager mode runs op by op.
# What a bottleneck verdict puts first: the knobs that act on the part of the step that binds.
FIRST = {"input-bound": ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "threads"),
         "overhead-bound": ("compile_mode", "batch_size")}
AGAIN = "again:"  # role prefix of a screen tried once more from a moved incumbent
INTERACTIONS: tuple[tuple[str, str], ...] = (
    ("precision", "compile_mode"), ("precision", "batch_size"), ("precision", "channels_last"),
    ("num_workers", "threads"), ("compile_mode", "checkpointing"))


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
    """Two-level screen from the incumbent (knobs alone and INTERACTIONS' pairs), each once more where the
    incumbent moved since, then `base`.

    `max_screens` caps the screening trials: knobs are screened in IMPACT order (the reference's bottleneck
    first), the rest left to `base`. Single-objective (maximize) only.
    """

    def __init__(self, base: BaseSampler, max_screens: int) -> None:
        self._base = base
        self._max_screens = max(0, max_screens)
        self._targets: dict[int, dict[str, Any]] = {}  # trial number -> the params this trial is to take

    # -- what to measure next ----------------------------------------------------------------

    @staticmethod
    def _reference(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
        return next((t for t in trials if t.user_attrs.get(REFERENCE_ATTR) and t.state == TrialState.COMPLETE), None)

    def _screens(self, ref: FrozenTrial) -> list[dict[str, Any]]:
        """The changes to screen, each {knob: other level}: every knob of the reference that has another
        value, in IMPACT order after the knobs its bottleneck puts FIRST, each pair of INTERACTIONS right after
        the second of its knobs."""
        order = (*FIRST.get(ref.user_attrs.get(BOTTLENECK_ATTR), ()), *IMPACT)
        rank: dict[str, int] = {}
        for k in order:
            rank.setdefault(k, len(rank))
        knobs = sorted(ref.params, key=lambda k: (rank.get(k, len(rank)), k))
        others = {k: farthest(ref.distributions[k], ref.params[k]) for k in knobs}
        out: list[dict[str, Any]] = []
        done: list[str] = []
        for knob in (k for k in knobs if others[k] is not None):
            out.append({knob: others[knob]})
            out += [{a: others[a], b: others[b]} for a, b in INTERACTIONS
                    if (a == knob and b in done) or (b == knob and a in done)]
            done.append(knob)
        return out

    def plan(self, study: "Study", number: int) -> tuple[str, dict[str, Any]] | None:
        """(role, params) for trial `number`: the incumbent with the next unscreened change (a knob, a pair),
        then with each change once more (where that makes a configuration not yet measured; first those that act
        together with a knob the incumbent moved), else None (the base sampler decides)."""
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != number]
        ref = self._reference(trials)
        if ref is None:
            return None
        screened = [t for t in trials if t.system_attrs.get(ROLE_ATTR)]
        if len(screened) >= self._max_screens:
            return None
        live = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)]
        roles = {t.system_attrs.get(ROLE_ATTR) for t in trials}  # a failed screen is not tried again
        best = max((t for t in [ref, *screened] if t.state == TrialState.COMPLETE and t.values),
                   key=lambda t: t.values[0])
        screens = self._screens(ref)
        moved = {k for k, v in best.params.items() if ref.params.get(k) != v}
        # once more: first the changes whose knob acts together with one the incumbent has moved since
        partners = {k for pair in INTERACTIONS if moved & set(pair) for k in pair} - moved
        again = sorted(screens, key=lambda c: not partners & set(c))
        for prefix, changes in (("", screens), (AGAIN, again)):
            for change in changes:  # a pair whose one change the incumbent holds screens the other from it
                role, params = prefix + _role(change), {**best.params, **change}
                if role not in roles and not any(_matches(t.params, params) for t in live):
                    return role, params
        return None

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


def _role(change: dict[str, Any]) -> str:
    """What a screening trial is for, as stored: "precision='bf16'" or "precision='bf16',compile_mode='default'"."""
    return ",".join(f"{k}={v!r}" for k, v in change.items())


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
                  values: list[float], bottleneck: str | None = None) -> bool:
    """Put the measured reference (the baseline) into the Optuna study as a finished trial, once:
    samplers learn from it and the screen starts from it, in the order its `bottleneck` verdict (the trial's
    Bottleneck.verdict) sets. False if it is there already."""
    if any(t.user_attrs.get(REFERENCE_ATTR) for t in study.get_trials(deepcopy=False)):
        return False
    attrs = {REFERENCE_ATTR: True, **({BOTTLENECK_ATTR: bottleneck} if bottleneck else {})}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, values=values,
                                              user_attrs=attrs))
    return True


__all__ = ["IMPACT", "INTERACTIONS", "ScreeningSampler", "add_reference", "contains", "farthest"]
