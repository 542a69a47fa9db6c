"""What a search space file says: each knob's domain and the conditions between knobs (pydantic).

A space is data a user can copy and edit (see presets/*.yaml); sample.py evaluates it against a
target (SpaceContext). Knobs not named in a space keep TrainingConfig's default.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from advisor.trial import TrainingConfig

Scalar = Union[bool, int, float, str, None]

# The order knobs are decided in. A condition may test only knobs decided before its own knob
# (Optuna's define-by-run: a parameter's existence depends on parameters already suggested).
# The layout comes first (tp, pp, cp and the pipeline's knobs), then the strategy of its data-parallel part;
# virtual_stages is derived from the schedule, nproc right after strategy, and grad_accum from
# --global-batch-size when one is given (search_spaces/layout.py).
ORDER: tuple[str, ...] = (
    "tp", "pp", "cp", "pp_schedule", "virtual_stages", "microbatches", "micro_batch_size", "strategy", "nproc",
    "batch_size", "grad_accum", "num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "precision",
    "compile_mode", "optimizer", "optimizer_impl", "fused_backward", "checkpointing", "channels_last", "pinning",
    "cpu_list", "threads", "lora_r",
)
# Set from the knobs before them and the device count, never searched: what each follows.
DERIVED: dict[str, str] = {
    "virtual_stages": "follows pp_schedule (2 for interleaved-1f1b, else 1)",
    "nproc": "follows strategy, tp, pp and cp (1 for single without them, the device count otherwise)",
}
KNOBS: tuple[str, ...] = tuple(k for k in ORDER if k not in DERIVED)
# Facts about the target a condition may test (SpaceContext.facts()).
FACTS: tuple[str, ...] = (
    "device", "device_count", "supports_bf16", "fast_bf16", "supports_fp16", "supports_tf32", "conv_net", "cpu_cores",
    "numa_nodes", "default_batch_size", "global_batch_size", "lora",
)
INT_KNOBS = ("batch_size", "grad_accum", "num_workers", "prefetch_factor", "threads", "tp", "pp", "cp", "microbatches",
             "micro_batch_size", "lora_r")
BOOL_KNOBS = ("pin_memory", "persistent_workers", "fused_backward", "channels_last")
# Categorical knobs that also take YAML's booleans: checkpointing (none, selective, full) reads true as full, false none
BOOLEAN_ALIASES = ("checkpointing",)
OPS = ("eq", "ne", "lt", "le", "gt", "ge", "in", "not_in")
BOUND = re.compile(r"^\s*([a-z_]+)\s*(?:([*/])\s*(\d+))?\s*$")


@lru_cache(maxsize=None)
def _adapter(knob: str) -> TypeAdapter:
    field = TrainingConfig.model_fields[knob]
    return TypeAdapter(Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation)


def allowed(knob: str) -> str:
    """What values `knob` takes, in words (for error messages)."""
    schema = _adapter(knob).json_schema()
    options = schema.get("anyOf", [schema])
    words = []
    for option in options:
        if "enum" in option:
            words.append(", ".join("null" if v is None else str(v) for v in option["enum"]))
        elif option.get("type") == "null":
            words.append("null")
        elif option.get("type") == "boolean":
            words.append("true, false")
        elif option.get("type") == "integer":
            low = option.get("minimum")
            if "exclusiveMinimum" in option:
                low = option["exclusiveMinimum"] + 1
            words.append("an integer" + (f" >= {low}" if low is not None else ""))
        else:
            words.append(option.get("type", "a value"))
    return "; ".join(words)


def check_value(knob: str, value: Any) -> Scalar:
    """`value` in its plain (JSON) form if `knob` accepts it, else ValueError saying what is allowed."""
    if knob not in KNOBS:
        raise ValueError(f"unknown knob {knob!r}; knobs: {', '.join(KNOBS)}")
    adapter = _adapter(knob)
    if isinstance(value, bool) and knob not in BOOL_KNOBS + BOOLEAN_ALIASES:  # YAML true is not the integer 1 here
        raise ValueError(f"{knob}: {value!r} is not allowed; allowed: {allowed(knob)}")
    try:
        return adapter.dump_python(adapter.validate_python(value), mode="json")
    except ValidationError:
        raise ValueError(f"{knob}: {value!r} is not allowed; allowed: {allowed(knob)}") from None


def _fact_bound(value: int | str) -> int | str:
    if isinstance(value, str):
        match = BOUND.match(value)
        if match is None or match.group(1) not in FACTS:
            raise ValueError(f"bound {value!r} is not an integer or FACT, FACT*N, FACT/N with a FACT among "
                             f"{', '.join(FACTS)}")
    return value


class Choices(BaseModel):
    """One of these values (categorical)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    choices: list[Scalar] = Field(min_length=1)

    @field_validator("choices")
    @classmethod
    def _distinct(cls, v: list[Scalar]) -> list[Scalar]:
        if len({repr(x) for x in v}) != len(v):
            raise ValueError(f"choices repeat a value: {v}")
        return v


class Fixed(BaseModel):
    """Always this value (not searched)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fixed: Scalar


class IntRange(BaseModel):
    """Integers from low to high inclusive: every `step`-th, log-uniform (`log`), or powers of two.

    A bound is an integer or a target fact, optionally scaled: `default_batch_size*4`, `cpu_cores/2`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    low: int | str
    high: int | str
    step: int = Field(default=1, ge=1)
    log: bool = Field(default=False, description="Sample log-uniformly (Optuna's log=True); needs step 1.")
    powers_of_two: bool = Field(default=False, description="Only 2**k within [low, high].")

    @field_validator("low", "high")
    @classmethod
    def _bound(cls, v: int | str) -> int | str:
        return _fact_bound(v)

    @model_validator(mode="after")
    def _check(self) -> "IntRange":
        if self.log and self.step != 1:
            raise ValueError("log and step cannot be combined (Optuna samples a log range with step 1)")
        if self.powers_of_two and (self.log or self.step != 1):
            raise ValueError("powers_of_two takes no step or log")
        if isinstance(self.low, int) and isinstance(self.high, int) and self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        return self


Domain = Union[Choices, Fixed, IntRange]


def _parse_domain(raw: Any) -> Any:
    if isinstance(raw, BaseModel):
        return raw
    if not isinstance(raw, dict):
        raise ValueError("a domain is a mapping: {choices: [...]}, {fixed: value} or {low: .., high: ..}; "
                         f"got {raw!r}")
    if "choices" in raw:
        return Choices.model_validate(raw)
    if "fixed" in raw:
        return Fixed.model_validate(raw)
    if "low" in raw or "high" in raw:
        return IntRange.model_validate(raw)
    raise ValueError(f"a domain needs `choices`, `fixed`, or `low` and `high`; got keys "
                     f"{', '.join(map(str, raw)) or 'none'}")


def _check_domain(knob: str, raw: Any) -> Domain:
    if knob not in KNOBS:
        hint = f"; {knob} {DERIVED[knob]}" if knob in DERIVED else ""
        raise ValueError(f"unknown knob {knob!r}{hint}; knobs: {', '.join(KNOBS)}")
    domain = _parse_domain(raw)
    if isinstance(domain, Choices):
        return Choices(choices=[check_value(knob, v) for v in domain.choices])
    if isinstance(domain, Fixed):
        return Fixed(fixed=check_value(knob, domain.fixed))
    if knob not in INT_KNOBS:
        raise ValueError(f"{knob} is not an integer knob, so it takes choices or fixed, not a range; "
                         f"integer knobs: {', '.join(INT_KNOBS)}")
    for bound in (domain.low, domain.high):
        if isinstance(bound, int):
            check_value(knob, bound)
    return domain


def _check_test(name: str, test: Any) -> None:
    operands: list[Any] = test if isinstance(test, list) else [test]
    if isinstance(test, dict):
        bad = [op for op in test if op not in OPS]
        if bad or not test:
            raise ValueError(f"when.{name}: operators {', '.join(map(str, bad)) or '(none)'} unknown; "
                             f"use {', '.join(OPS)}")
        for op in ("in", "not_in"):
            if op in test and not isinstance(test[op], list):
                raise ValueError(f"when.{name}.{op} takes a list, got {test[op]!r}")
        operands = [x for op, arg in test.items() for x in (arg if op in ("in", "not_in") else [arg])]
    # A misspelt value (strategy: singel) would silently never match: check it against the knob.
    for operand in operands:
        if name in KNOBS:
            check_value(name, operand)
        elif name == "device" and operand not in ("cpu", "cuda"):
            raise ValueError(f"when.device: {operand!r} is not allowed; allowed: cpu, cuda")


class Condition(BaseModel):
    """When a knob (or some of its values) applies.

    Without `values`: the knob is searched only when every test in `when` holds, else it takes
    `otherwise` (default: TrainingConfig's default); tests may name target facts and knobs decided
    earlier (ORDER). With `values`: those values are allowed only when `when` holds; such tests
    name target facts only, so a study's choices stay the same from trial to trial.
    `when` maps a name to a value (equal), a list (one of) or operators {ge: 1, ne: x, in: [...]}.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    knob: str
    values: list[Scalar] | None = Field(default=None, min_length=1)
    when: dict[str, Any] = Field(min_length=1)
    why: str = Field(default="", description="One line shown when the condition excludes a value.")
    otherwise: Scalar = None
    advisory: bool = Field(default=False, description="A preference, not a limit of the target: it keeps values "
                           "out of a searched knob, never out of a fixed one (--fix or `fixed:`).")

    @field_validator("when")
    @classmethod
    def _aliases(cls, when: dict[str, Any]) -> dict[str, Any]:
        """A boolean tested against a knob in BOOLEAN_ALIASES as the value it stands for (true: full), the form
        the decided knob holds."""
        def value(name: str, x: Any) -> Any:
            return check_value(name, x) if isinstance(x, bool) else x

        def test(name: str, t: Any) -> Any:
            if isinstance(t, dict):
                return {op: test(name, arg) for op, arg in t.items()}
            return [value(name, x) for x in t] if isinstance(t, list) else value(name, t)

        return {name: test(name, t) if name in BOOLEAN_ALIASES else t for name, t in when.items()}

    @model_validator(mode="after")
    def _check(self) -> "Condition":
        if self.knob not in KNOBS:
            raise ValueError(f"condition on unknown knob {self.knob!r}; knobs: {', '.join(KNOBS)}")
        for name, test in self.when.items():
            if name not in ORDER and name not in FACTS:
                raise ValueError(f"when.{name}: not a knob or a target fact; facts: {', '.join(FACTS)}; "
                                 f"knobs: {', '.join(ORDER)}")
            _check_test(name, test)
        knobs_tested = [n for n in self.when if n not in FACTS]
        if self.values is not None:
            [check_value(self.knob, v) for v in self.values]
            if knobs_tested:
                raise ValueError(f"a condition on values of {self.knob} may test target facts only, not "
                                 f"{', '.join(knobs_tested)}; drop `values` to make the whole knob conditional")
            if "otherwise" in self.model_fields_set:
                raise ValueError("`otherwise` belongs to a condition without `values`")
        elif self.advisory:
            raise ValueError("`advisory` belongs to a condition with `values`")
        late = [n for n in knobs_tested if ORDER.index(n) >= ORDER.index(self.knob)]
        if late:
            raise ValueError(f"{self.knob} is decided before {', '.join(late)}, so it cannot depend on it; "
                             f"knobs are decided in this order: {', '.join(ORDER)}")
        if "otherwise" in self.model_fields_set:
            check_value(self.knob, self.otherwise)
        return self

    @property
    def off_value(self) -> Scalar:
        """The knob's value when this (knob-wide) condition does not hold."""
        if "otherwise" in self.model_fields_set:
            return check_value(self.knob, self.otherwise)
        return _adapter(self.knob).dump_python(TrainingConfig.model_fields[self.knob].default, mode="json")

    def normalized_values(self) -> list[Scalar]:
        return [check_value(self.knob, v) for v in self.values or []]


class SearchSpace(BaseModel):
    """Knob domains and conditions; a knob left out keeps TrainingConfig's default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    description: str = ""
    knobs: dict[str, Domain] = Field(default_factory=dict)
    conditions: list[Condition] = Field(default_factory=list)

    @field_validator("knobs", mode="before")
    @classmethod
    def _knobs(cls, raw: Any) -> dict[str, Domain]:
        if not isinstance(raw, dict):
            raise ValueError(f"knobs is a mapping of knob name to domain, got {type(raw).__name__}")
        out = {}
        for knob, domain in raw.items():
            try:
                out[knob] = _check_domain(knob, domain)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                msg = first["msg"].removeprefix("Value error, ")
                if first["type"] == "extra_forbidden":
                    model = {m.__name__: m for m in (Choices, Fixed, IntRange)}[exc.title]
                    msg = f"unknown field; allowed: {', '.join(model.model_fields)}"
                raise ValueError(f"{knob}{'.' + where if where else ''}: {msg}") from None
            except ValueError as exc:
                raise ValueError(f"{knob}: {exc}" if not str(exc).startswith(knob) else str(exc)) from None
        return out

    def domain(self, knob: str) -> Domain:
        """The knob's domain; TrainingConfig's default (fixed) where the space leaves it out."""
        if knob in self.knobs:
            return self.knobs[knob]
        return Fixed(fixed=_adapter(knob).dump_python(TrainingConfig.model_fields[knob].default, mode="json"))
