"""TuneRequest: everything `advisor tune` was asked, and the study it names.

The study's name is derived from what changes the search (workload, its arguments, hardware,
space, fixes, objective, global batch, sampler), so rerunning the same command continues the
same study; a different budget or seed does not start a new one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.trial import TrialBudget

# tpe: screen each knob and each interacting pair against the baseline, combine the winners, then
# multivariate TPE (advisor/tune/screening.py);
# tpe-plain: Optuna's TPE alone.
Sampler = Literal["tpe", "tpe-plain", "random", "nsga2", "brute-force"]
SAMPLERS: tuple[str, ...] = get_args(Sampler)
Executor = Literal["auto", "ray", "inline"]
EXECUTORS: tuple[str, ...] = get_args(Executor)


class TuneRequest(BaseModel):
    """One `advisor tune` run. Budget fields bound this run; the study carries over between runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str = Field(description="Preset name, path/to/file.py:build or pkg.module:build.")
    workload_args: dict[str, Any] = Field(default_factory=dict)
    hardware: str = Field(default="local", description="A hardware spec string (advisor hardware).")
    space: str = Field(default="quick", description="A search-space preset name or a YAML file.")
    fixes: dict[str, Any] = Field(default_factory=dict, description="Knobs held at one value (--fix).")
    objective: Literal["throughput", "throughput,memory"] = "throughput"
    global_batch_size: int | None = Field(default=None, gt=0,
                                          description="Samples per optimizer step, kept by grad_accum.")
    sampler: Sampler | None = Field(default=None,
                                    description="None: TPE, NSGA-II for two objectives, brute force for 'exhaustive'.")
    trials: int = Field(default=20, gt=0,
                        description="Distinct configurations to measure in the study, baseline included.")
    time_budget_s: float | None = Field(default=None, gt=0, description="Stop starting trials after this long (s).")
    patience: int | None = Field(default=None, gt=0,
                                 description="Stop after this many measured trials without a better one.")
    seed: int = 0
    study: str | None = Field(default=None, description="Study name; default derived from the search's inputs.")
    db: str | None = Field(default=None, description="Database URL; default the settings' database_url.")
    ray_address: str | None = Field(default=None, description="An existing Ray cluster; default a local one.")
    executor: Executor = Field(default="auto", description="What runs the trials: 'ray', Ray Tune's trial runner on a "
                               "local Ray or --ray-address's cluster; 'inline', one at a time from the tuner's own "
                               "process, without Ray; 'auto', inline where trials run one at a time on this host "
                               "(a CPU, or one device per node) and no cluster is named, else Ray.")
    remeasure: bool = Field(default=False, description="Measure again what the store already has for this fingerprint.")
    confirm: int | None = Field(default=None, ge=0, description="Trials of the budget kept to measure the leading "
                                "configurations again (advisor/tune/confirm.py); default: an eighth of the budget, "
                                "none under 8 trials or for brute force.")
    margin: float | None = Field(default=None, ge=0, lt=1, description="Memory kept free when pruning (fraction).")
    trial_budget: TrialBudget = Field(default_factory=lambda: TrialBudget(warmup_steps=2, min_steps=5, min_time_s=2.0,
                                                                          timeout_s=300.0))

    @model_validator(mode="after")
    def _check(self) -> "TuneRequest":
        if self.sampler == "nsga2" and self.objective == "throughput":
            raise ValueError("sampler nsga2 is for the two-objective search; use --objective throughput,memory")
        if self.executor == "inline" and self.ray_address:
            raise ValueError("--executor inline runs without Ray; --ray-address needs --executor ray or auto")
        return self

    def absolute(self) -> "TuneRequest":
        """Workload and space files made absolute, so Ray workers (other working dirs) find them."""
        update: dict[str, Any] = {}
        path, sep, attr = self.workload.rpartition(":")
        if self.workload.startswith("hf:"):
            update["workload"] = f"hf:{Path(self.workload.removeprefix('hf:')).expanduser().resolve()}"
        elif sep and (path.endswith(".py") or "/" in path):
            update["workload"] = f"{Path(path).resolve()}:{attr}"
        if self.space.endswith((".yaml", ".yml")) or "/" in self.space:
            update["space"] = str(Path(self.space).resolve())
        return self.model_copy(update=update)

    def resolved_sampler(self) -> Sampler:
        if self.sampler:
            return self.sampler
        if self.objective == "throughput,memory":
            return "nsga2"
        return "brute-force" if Path(self.space).stem == "exhaustive" else "tpe"

    def resolved_confirm(self) -> int:
        """Trials kept for measuring leaders again: `confirm`, else trials // 8 (brute force measures the whole
        space once, so it keeps none). Always fewer than the budget."""
        wanted = self.confirm if self.confirm is not None else \
            0 if self.resolved_sampler() == "brute-force" else self.trials // 8
        return max(0, min(wanted, self.trials - 1))

    def study_name(self, workload_name: str, hardware_name: str) -> str:
        if self.study:
            return self.study
        key = json.dumps({"w": self.workload, "a": self.workload_args, "h": self.hardware, "s": self.space,
                          "f": self.fixes, "o": self.objective, "g": self.global_batch_size,
                          "x": self.resolved_sampler()}, sort_keys=True, default=str)
        return f"{workload_name}@{hardware_name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
