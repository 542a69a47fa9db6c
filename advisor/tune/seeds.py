"""The planner's top plans as the tuner's first trials: on CUDA GPUs, for a decoder, whose space searches its
parallel layout, the configurations advisor/plan ranks fastest (memory from the analytic estimator, time from the
step-time model) run right after the baseline, each as the space would have drawn it."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from advisor.errors import AdvisorError
from advisor.trial import TrainingConfig

log = logging.getLogger(__name__)

# the layout knobs a plan decides (a space that searches none has nothing for the planner to order), and the rest
LAYOUT = ("tp", "pp", "cp", "strategy", "dp_replicate", "pp_schedule", "virtual_stages", "microbatches",
          "micro_batch_size")
PLANNED = (*LAYOUT, "batch_size", "grad_accum", "checkpointing", "precision", "optimizer_impl")


class _Miss(Exception):
    """The plan's value of a knob is not among the knob's values in the space on this target."""


# sizes a space bounds on its own terms: a plan's value is taken at the nearest the space holds, at most the plan's
# where it can (a smaller batch than planned fits where the plan's does)
SIZES = ("batch_size", "micro_batch_size", "microbatches", "grad_accum")


class _Answers:
    """Stands in for an Optuna trial in search_spaces.suggest, answering each knob from `values` (a plan's
    configuration, else the baseline's): the value itself where the space holds it, the nearest for SIZES, the
    space's first value for a knob no plan decides."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = values

    def _pick(self, name: str, allowed: list[Any]) -> Any:
        from search_spaces.layout import knob_of

        knob = knob_of(name)
        value = self.values.get(knob)
        if value in allowed:
            return value
        sizes = [v for v in allowed if isinstance(v, int) and not isinstance(v, bool)]
        if knob in SIZES and isinstance(value, int) and sizes:
            below = [v for v in sizes if v <= value]
            return max(below) if below else min(sizes)
        if knob not in PLANNED:  # the baseline's value, where the space does not hold it: the space's first
            return allowed[0]
        raise _Miss(f"{name}={value!r}")

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return self._pick(name, choices)

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int:
        return self._pick(name, list(range(low, high + 1, step)))


def planner_seeds(decoder: Any, hw: Any, space: Any, context: Any, base: TrainingConfig,
                  top: int = 3) -> list[TrainingConfig]:
    """Up to `top` configurations of the planner's best plans that the space can draw on `hw`, fastest first;
    [] where the planner does not apply (not CUDA GPUs, not a decoder, a space that searches no knob a plan
    decides) or nothing it plans fits. The planner plans at its default global batch (docs/planner.md) unless the
    context gives one, in the baseline's optimizer, and in its precision where the space does not search it."""
    from advisor.plan.knobs import FixedKnobs
    from advisor.plan.model import PlanRequest
    from advisor.plan.recommend import training_config
    from advisor.plan.search import plan
    from search_spaces import suggest

    if hw.device_type != "cuda" or decoder is None or not any(k in space.knobs for k in LAYOUT):
        return []
    fixed = {"optimizer": base.optimizer}
    if "precision" not in space.knobs:
        fixed["precision"] = base.precision
    try:
        target = f"{hw.accelerator.name}:{hw.devices_per_node}x{hw.nodes}"
        result = plan(PlanRequest(arch=decoder, hardware=[target], top=top * 4, fixed=FixedKnobs(**fixed),
                                  global_batch_size=context.global_batch_size))
    except AdvisorError as exc:  # a space or target the planner cannot take: the search goes on without seeds
        log.info("no planned seeds: %s", exc)
        return []
    seeds: list[TrainingConfig] = []
    for p in result.plans if result.fits else []:
        try:
            wanted = training_config(p.config)
        except ValueError:  # offloaded: no trial runs it
            continue
        values = {**base.model_dump(mode="json"), **wanted.model_dump(mode="json", include=set(PLANNED) | {"nproc"})}
        try:
            config = suggest(space, _Answers(values), context)
        except (_Miss, AdvisorError):  # a knob's value the space does not hold, or sizes that do not compose
            continue
        if config is not None and config not in seeds and config != base:
            seeds.append(config)
        if len(seeds) == top:
            break
    return seeds
