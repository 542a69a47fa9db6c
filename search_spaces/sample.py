"""A space evaluated against a target: Optuna's define-by-run `suggest`, the full `grid`, the
PyTorch-defaults `baseline`, and `--fix` overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from pydantic import ValidationError

from advisor.config import OptimizerKind
from advisor.errors import SpecError
from advisor.trial import TrainingConfig
from search_spaces import layout
from search_spaces.context import SpaceContext
from search_spaces.spec import BOUND, KNOBS, ORDER, Choices, Condition, Fixed, Scalar, SearchSpace, check_value

if TYPE_CHECKING:
    import optuna

GRID_LIMIT = 100_000  # configurations; past this `grid` asks for --fix or a sampler instead
_SKIP = object()  # this branch cannot reach the global batch size


def _test(value: Any, test: Any) -> bool:
    if isinstance(test, dict):
        return all(_op(op, value, arg) for op, arg in test.items())
    if isinstance(test, list):
        return value in test
    return value == test


def _op(op: str, value: Any, arg: Any) -> bool:
    if op == "eq":
        return value == arg
    if op == "ne":
        return value != arg
    if op == "in":
        return value in arg
    if op == "not_in":
        return value not in arg
    if value is None or arg is None:  # an unknown fact satisfies no comparison
        return False
    return {"lt": value < arg, "le": value <= arg, "gt": value > arg, "ge": value >= arg}[op]


def holds(condition: Condition, known: Mapping[str, Any]) -> bool:
    """Whether every test in `condition.when` holds for these facts and decided knobs."""
    return all(_test(known.get(name), test) for name, test in condition.when.items())


@dataclass(frozen=True)
class Resolved:
    """A knob's domain on one target: categorical `values`, or an Optuna int range when `int_range`."""

    knob: str
    values: tuple[Scalar, ...]
    int_range: tuple[int, int, int, bool] | None = None  # low, high, step, log
    param: str = ""  # the Optuna parameter that asks it: the knob, or layout.restricted_name

    @property
    def single(self) -> bool:
        return len(self.values) == 1

    @property
    def name(self) -> str:
        return self.param or self.knob


def _bound(bound: int | str, facts: Mapping[str, Any], knob: str) -> int:
    """An integer bound, or a fact scaled as written: `default_batch_size*4`, `cpu_cores/2` (floor, >= 1)."""
    if isinstance(bound, int):
        return bound
    match = BOUND.match(bound)
    assert match is not None  # checked when the space was loaded
    name, op, scale = match.groups()
    value = facts.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"{knob}: bound {bound!r} needs {name}, which is unknown for this target; give a number")
    if op is None:
        return value
    return value * int(scale) if op == "*" else max(1, value // int(scale))


def _domain_values(space: SearchSpace, knob: str, context: SpaceContext, facts: Mapping[str, Any]) -> Resolved:
    domain = space.domain(knob)
    if isinstance(domain, Fixed):
        return Resolved(knob, (domain.fixed,))
    if isinstance(domain, Choices):
        return Resolved(knob, tuple(domain.choices))
    low, high = _bound(domain.low, facts, knob), _bound(domain.high, facts, knob)
    low = max(low, 1 if knob != "num_workers" else 0)
    if low > high:
        raise SpecError(f"{knob}: the range {domain.low}..{domain.high} is empty on this target ({low}..{high})")
    if domain.powers_of_two:
        powers = tuple(1 << k for k in range(high.bit_length()) if low <= 1 << k <= high)
        if not powers:
            raise SpecError(f"{knob}: no power of two lies in {low}..{high}")
        return Resolved(knob, powers)
    return Resolved(knob, tuple(range(low, high + 1, domain.step)), (low, high, domain.step, domain.log))


def _restrict(res: Resolved, space: SearchSpace, context: SpaceContext, facts: Mapping[str, Any]) -> Resolved:
    """Drop the values the target excludes (value conditions; advisory ones only from a searched
    knob) and, with a global batch, the batch sizes that do not divide it. A range that loses
    values becomes a list of choices."""
    excluded: dict[Scalar, str] = {}
    fixed = isinstance(space.domain(res.knob), Fixed)
    for cond in space.conditions:
        if cond.advisory and fixed:
            continue  # the user chose this value; an advisory condition only steers the search
        if cond.knob == res.knob and cond.values is not None and not holds(cond, facts):
            for value in cond.normalized_values():
                excluded.setdefault(value, cond.why or f"needs {cond.when}")
    g = context.global_batch_size
    if res.knob == "batch_size" and g is not None:
        excluded.update({b: f"does not divide the global batch {g}" for b in res.values if g % b})
    excluded.update(layout.excluded(res.knob, res.values, context, fixed=fixed))
    kept = tuple(v for v in res.values if v not in excluded)
    if not kept:
        reasons = "; ".join(f"{v}: {why}" for v, why in excluded.items() if v in res.values)
        raise SpecError(f"{res.knob}: no value of the space applies on this target ({reasons})")
    if len(kept) == len(res.values):
        return res
    return Resolved(res.knob, kept)


class Plan:
    """A space resolved against one target: each knob's values, and which knob conditions apply."""

    def __init__(self, space: SearchSpace, context: SpaceContext) -> None:
        if context.global_batch_size is not None and "grad_accum" in space.knobs:
            raise SpecError(f"space {space.name} searches grad_accum, but a global batch size derives it; "
                            "remove grad_accum from the space or drop the global batch size")
        self.space, self.context, self.facts = space, context, context.facts()
        self._domains: dict[str, Resolved] = {}
        self.gates = {k: [c for c in space.conditions if c.knob == k and c.values is None] for k in KNOBS}

    def pending(self, knob: str, decided: Mapping[str, Any]) -> tuple[Any, Resolved | None]:
        """(value, None) when `knob` is settled by what is decided so far, else (None, its domain); the value
        is _SKIP where no value of `knob` can go with the knobs decided so far."""
        g = self.context.global_batch_size
        if knob == "grad_accum" and g is not None:
            # a step's samples come from the data-parallel replicas; tp and pp ranks share theirs
            per_step = decided["batch_size"] * (decided["nproc"] // layout.ranks(decided))
            if g % per_step or not layout.viable(knob, (g // per_step,), decided, self.context):
                return _SKIP, None
            return g // per_step, None
        is_set, value = layout.settled(knob, decided, self.context)
        if is_set:
            return value, None
        known = {**self.facts, **decided}
        for cond in self.gates[knob]:
            if not holds(cond, known):
                return cond.off_value, None
        domain = self.domain(knob)
        kept = layout.viable(knob, domain.values, decided, self.context)
        if not kept:
            return _SKIP, None
        if len(kept) < len(domain.values):
            domain = Resolved(knob, kept, param=layout.restricted_name(knob, kept))
        return (domain.values[0], None) if domain.single else (None, domain)

    def domain(self, knob: str) -> Resolved:
        """The knob's values on this target (resolved on first use: a knob that is never reached,
        its conditions failing, never needs the facts its bounds name)."""
        if knob not in self._domains:
            res = _domain_values(self.space, knob, self.context, self.facts)
            self._domains[knob] = _restrict(res, self.space, self.context, self.facts)
        return self._domains[knob]

    def config(self, decided: Mapping[str, Any]) -> TrainingConfig:
        try:
            return TrainingConfig(device=self.context.device, **decided)
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise SpecError(f"space {self.space.name} yields an invalid configuration ({problem}); add a "
                            f"condition so the knobs cannot meet like this: {dict(decided)}") from exc


def suggest(space: SearchSpace, trial: "optuna.Trial", context: SpaceContext) -> TrainingConfig | None:
    """Ask `trial` (define-by-run) for the knobs whose conditions hold; the rest take their fixed,
    conditional-off or derived values. A knob the layout decided before leaves fewer values is asked
    under a name listing them (search_spaces/layout.py). None when the draw cannot reach the global
    batch size, or no value of a knob goes with its layout."""
    plan = Plan(space, context)
    decided: dict[str, Any] = {}
    for knob in ORDER:
        value, domain = plan.pending(knob, decided)
        if value is _SKIP:
            return None
        if domain is not None:
            if domain.int_range is not None:
                low, high, step, log = domain.int_range
                value = trial.suggest_int(domain.name, low, high, step=step, log=log)
            else:
                value = trial.suggest_categorical(domain.name, list(domain.values))
        decided[knob] = value
    return plan.config(decided)


def iter_grid(space: SearchSpace, context: SpaceContext) -> Iterator[TrainingConfig]:
    """Every valid combination, in ORDER; knobs whose conditions fail do not branch, nor do values the
    layout decided before rules out."""
    plan = Plan(space, context)

    def expand(i: int, decided: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(ORDER):
            yield decided
            return
        knob = ORDER[i]
        value, domain = plan.pending(knob, decided)
        if value is _SKIP:
            return
        for v in (value,) if domain is None else domain.values:
            yield from expand(i + 1, {**decided, knob: v})

    for decided in expand(0, {}):
        yield plan.config(decided)


def grid(space: SearchSpace, context: SpaceContext, limit: int = GRID_LIMIT) -> list[TrainingConfig]:
    """`iter_grid` as a list; SpecError past `limit` configurations (fix some knobs, or sample)."""
    out = []
    for config in iter_grid(space, context):
        if len(out) == limit:
            raise SpecError(f"space {space.name} has more than {limit} configurations on this target; "
                            "fix some knobs (--fix knob=value) or use a sampler instead of the grid")
        out.append(config)
    return out


def baseline(context: SpaceContext, optimizer: OptimizerKind | str = OptimizerKind.adamw) -> TrainingConfig:
    """PyTorch defaults: the workload's batch size, fp32, eager, no workers, no pinning, one process.

    With a global batch size, grad_accum keeps it: the batch is the workload's own if it divides
    the global batch, else the largest divisor of the global batch below it.
    """
    batch, accum, g = context.default_batch_size, 1, context.global_batch_size
    if g is not None:
        batch = max(d for d in range(1, min(batch, g) + 1) if g % d == 0)
        accum = g // batch
    return TrainingConfig(device=context.device, batch_size=batch, grad_accum=accum, optimizer=OptimizerKind(optimizer))


def parse_fixes(pairs: list[str] | None) -> dict[str, Any]:
    """['precision=bf16', 'num_workers=4'] -> {'precision': 'bf16', 'num_workers': 4} (YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or []:
        knob, sep, raw = pair.partition("=")
        if not sep or not knob.strip():
            raise SpecError(f"--fix {pair!r} is not knob=value; knobs: {', '.join(KNOBS)}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out[knob.strip()] = value if isinstance(value, (bool, int, float, str, type(None))) else raw
    return out


def apply_fixes(space: SearchSpace, fixes: Mapping[str, Any]) -> SearchSpace:
    """`space` with each named knob fixed to its value; SpecError naming the allowed knobs or values."""
    knobs = dict(space.knobs)
    for knob, value in fixes.items():
        if knob not in KNOBS:
            raise SpecError(f"--fix {knob}: unknown knob; knobs: {', '.join(KNOBS)}")
        try:
            knobs[knob] = Fixed(fixed=check_value(knob, value))
        except ValueError as exc:
            raise SpecError(f"--fix {knob}={value}: {exc}") from None
    return space.model_copy(update={"knobs": knobs})


__all__ = ["GRID_LIMIT", "Plan", "Resolved", "apply_fixes", "baseline", "grid", "holds", "iter_grid",
           "parse_fixes", "suggest"]
