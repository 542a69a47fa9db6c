"""The layout knobs in a space (tp, pp, cp, the pipeline schedule, micro-batches or their size) against one target:
which values its devices and the workload's decoder allow, given the knobs decided before, and what the other knobs
become under a layout. The rules are advisor.parallel.layout's and TrainingConfig's own checks, not restated here.

Optuna keeps a parameter's choices the same from trial to trial. Where the knobs decided before leave a knob
fewer values than its domain, it is asked under a name that lists them (`restricted_name`): `strategy` with
tp > 1 is asked as `strategy[zero2,zero3]`, so no draw is wasted on a layout that cannot run.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping

from advisor.config import Strategy
from advisor.parallel.layout import Layout, PipelineSchedule, layout_problems, structural_problems
from advisor.trial import TrainingConfig, pipeline_microbatches

if TYPE_CHECKING:
    from search_spaces.context import SpaceContext

NAME_LIMIT = 100  # characters of a restricted parameter's value list
MODEL = "the workload"  # how problems name the model (a space is evaluated without its name)
PIPELINE_KNOBS = ("pp_schedule", "microbatches", "micro_batch_size")  # apply with pp > 1 only
# The knobs whose values the layout decided before them may rule out (tp's depend on the target only) ...
CHECKED = ("pp", "cp", "pp_schedule", "microbatches", "micro_batch_size", "strategy", "batch_size")
# ... and those TrainingConfig restricts under tp or pp: a tp/pp rank program compiles nothing, steps its
# optimizer after backward, and has no fp16 loss scaler across stages.
WITH_LAYOUT = ("precision", "compile_mode", "fused_backward")
LAYOUT_KNOBS = ("tp", "pp", "cp", "pp_schedule", "virtual_stages", "microbatches", "strategy", "nproc")


def ranks(decided: Mapping[str, Any]) -> int:
    """tp x pp x cp of the knobs decided so far (1 until they are)."""
    return decided.get("tp", 1) * decided.get("pp", 1) * decided.get("cp", 1)


def excluded(knob: str, values: tuple[Any, ...], context: "SpaceContext", *, fixed: bool) -> dict[Any, str]:
    """The tp, pp or cp values the target rules out, with why: each must divide the device count and fit the
    decoder (tp divides its heads, kv_heads and ffn; pp at most its layers, untied embeddings; cp splits seq_len
    into 2 x cp chunks). A model that is not a decoder searches none; a `fixed` tp stays (tp splits other models'
    Linear pairs too)."""
    if knob not in ("tp", "pp", "cp"):
        return {}
    out = {}
    for v in values:
        why = problem({knob: v}, context) if v != 1 else None
        if why is None and v != 1 and context.decoder is None and not fixed:
            why = f"{knob} > 1 is searched for decoder workloads only; {MODEL} is not one"
        if why is not None:
            out[v] = why
    return out


def viable(knob: str, values: tuple[Any, ...], decided: Mapping[str, Any], context: "SpaceContext") -> tuple:
    """Those of `values` that `knob` may take after the knobs `decided` (all of them for a knob the layout
    does not constrain)."""
    if knob in CHECKED:
        return tuple(v for v in values if problem({**decided, knob: v}, context) is None)
    if knob in WITH_LAYOUT and ranks(decided) > 1:
        mesh = {k: decided[k] for k in LAYOUT_KNOBS}
        return tuple(v for v in values if _accepts(context.device, {**mesh, knob: v}))
    return values


def restricted_name(knob: str, values: tuple[Any, ...]) -> str:
    """The Optuna parameter that asks `knob` among `values` only: `strategy[zero2,zero3]`; a long list by its
    length and digest (Optuna's stores keep names of up to 512 characters)."""
    listed = ",".join("null" if v is None else str(v) for v in values)
    if len(listed) > NAME_LIMIT:
        listed = f"{len(values)} values {hashlib.sha1(listed.encode()).hexdigest()[:12]}"
    return f"{knob}[{listed}]"


def knob_of(param: str) -> str:
    """The knob an Optuna parameter sets (`strategy[zero2,zero3]` -> `strategy`)."""
    return param.split("[", 1)[0]


def settled(knob: str, decided: Mapping[str, Any], context: "SpaceContext") -> tuple[bool, Any]:
    """(True, value) where the knobs decided so far leave `knob` one value, else (False, None).

    virtual_stages follows the schedule (2 for interleaved-1f1b) and nproc the strategy and layout (the
    device count unless single without tp or pp); without pp the pipeline knobs do not apply.
    """
    if knob == "virtual_stages":
        return True, 2 if PipelineSchedule(decided["pp_schedule"]).looped else 1
    if knob == "nproc":
        alone = decided["strategy"] == "single" and ranks(decided) == 1
        return True, 1 if alone else context.device_count
    if knob in PIPELINE_KNOBS and decided.get("pp", 1) == 1:
        return True, _default(knob)
    return False, None


def problem(decided: Mapping[str, Any], context: "SpaceContext") -> str | None:
    """Why the layout of the knobs decided so far cannot run on the target (one line), or None.

    Each knob not decided yet takes a value that accepts any layout that some value accepts: the strategy
    single for one replica and zero2 for several, the 1f1b schedule, the fewest micro-batches, any batch (one that
    micro_batch_size divides).
    """
    tp, pp, cp = decided.get("tp", 1), decided.get("pp", 1), decided.get("cp", 1)
    if tp * pp * cp == 1:
        return None
    microbatches, why = pipeline_microbatches(decided.get("batch_size"), decided.get("microbatches"),
                                              decided.get("micro_batch_size"))
    if why is not None and pp > 1:
        return why
    n = context.device_count
    dp = max(n // (tp * pp * cp), 1)
    schedule = PipelineSchedule(decided.get("pp_schedule", PipelineSchedule.one_f_one_b))
    strategy = Strategy(decided.get("strategy", Strategy.single if dp * cp == 1 else Strategy.zero2))
    lay = Layout.model_construct(dp=dp, tp=tp, pp=pp, cp=cp, strategy=strategy, schedule=schedule,
                                 microbatches=microbatches, virtual_stages=2 if schedule.looped else 1)
    found = layout_problems(lay, world=n, decoder=context.decoder, model_name=MODEL,
                            batch_size=decided.get("batch_size")) + structural_problems(lay)
    return found[0] if found else None


def _accepts(device: str, knobs: dict[str, Any]) -> bool:
    """Whether TrainingConfig takes these knobs, the others at their defaults."""
    try:
        TrainingConfig(device=device, **knobs)
    except ValueError:  # pydantic's ValidationError is one
        return False
    return True


def _default(knob: str) -> Any:
    default = TrainingConfig.model_fields[knob].default
    return getattr(default, "value", default)  # enums as a space writes them
