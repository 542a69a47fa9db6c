"""Fine-tuning as one transformation of a Workload: modules frozen by name, and LoRA adapters (peft) on a
frozen base. The fine-tune travels with the workload's arguments (under FINETUNE_ARG), so every command, the
isolated workers and the trial ranks build the same model from the same (spec, args)."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from advisor.config import Precision
from advisor.errors import SpecError, invalid_input

if TYPE_CHECKING:
    import argparse

    from advisor.workload import Workload

# The workload-args key a fine-tune travels under: not an identifier, so no build(**kwargs) parameter can be it.
FINETUNE_ARG = "advisor:finetune"
# Set on the root module of a model `finetune` built: its frozen parameters follow the precision (`hold_frozen`).
FROZEN_BASE = "advisor_frozen_base"
MAX_PATTERNS = 64  # freeze patterns and LoRA targets, each
MAX_PATTERN = 200  # characters of one


class LoraSpec(BaseModel):
    """LoRA adapters (Hu et al. 2021) through peft: each targeted layer's frozen weight W gets a trained update
    (alpha / r) x B A, A of r x in_features and B of out_features x r."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    r: int = Field(ge=1, le=65536, description="Rank of each adapter.")
    alpha: float | None = Field(default=None, gt=0, description="Scale numerator (the update is scaled by alpha / "
                                "r); None: r, a scale of 1.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on each adapter's input (probability).")
    targets: tuple[str, ...] = Field(min_length=1, max_length=MAX_PATTERNS, description="Module names the adapters "
                                     "wrap, as peft's target_modules: a name matches where it ends with one of these "
                                     "(q_proj matches layers.0.attn.q_proj).")

    @field_validator("targets")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_names(v, "LoRA target")


class FineTune(BaseModel):
    """What of the workload's model trains: every parameter but those of the modules `freeze` names, or, with
    `lora`, only the adapters (the whole base frozen). A frozen parameter has no gradient and no optimizer state;
    under precision bf16 or bf16-pure it is held in bf16 (`hold_frozen`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    freeze: tuple[str, ...] = Field(default=(), max_length=MAX_PATTERNS, description="Module-name patterns "
                                    "(fnmatch: * any run of characters, ? one, [..] a set), matched against each "
                                    "module's qualified name (blocks.0.attn); a match freezes all of that module's "
                                    "parameters. Each must match at least one module.")
    lora: LoraSpec | None = Field(default=None, description="LoRA adapters on a frozen base; None: no adapters.")

    @field_validator("freeze")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_names(v, "freeze pattern")

    @property
    def empty(self) -> bool:
        return not self.freeze and self.lora is None


def _checked_names(names: tuple[str, ...], what: str) -> tuple[str, ...]:
    for name in names:
        if not name.strip() or len(name) > MAX_PATTERN:
            raise ValueError(f"{what} {name[:MAX_PATTERN]!r} must be 1 to {MAX_PATTERN} characters, not blank")
    return names


def with_finetune(args: dict[str, Any] | None, spec: FineTune | None) -> dict[str, Any]:
    """The workload args that build the workload fine-tuned by `spec` (the args as given where it is None or
    empty)."""
    out = {k: v for k, v in (args or {}).items() if k != FINETUNE_ARG}
    if spec is not None and not spec.empty:
        out[FINETUNE_ARG] = spec.model_dump(mode="json", exclude_defaults=True)
    return out


def finetune_of(args: dict[str, Any] | None) -> FineTune | None:
    """The fine-tune the workload args carry, or None; SpecError where it is not a valid one."""
    raw = (args or {}).get(FINETUNE_ARG)
    if raw is None:
        return None
    try:
        return raw if isinstance(raw, FineTune) else FineTune.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc) from exc


def has_lora(args: dict[str, Any] | None) -> bool:
    """Whether the workload args carry a fine-tune with LoRA adapters (the search spaces' `lora` fact)."""
    spec = finetune_of(args)
    return spec is not None and spec.lora is not None


def with_rank(args: dict[str, Any] | None, r: int | None) -> dict[str, Any]:
    """The workload args with their LoRA rank set to `r` (the lora_r knob of a TrainingConfig); as given where
    `r` is None. SpecError where `r` is set and the args carry no LoRA."""
    args = dict(args or {})
    if r is None:
        return args
    spec = finetune_of(args)
    if spec is None or spec.lora is None:
        raise SpecError(f"lora_r {r} needs a LoRA fine-tune (--lora r=..., --lora-targets ...); this workload has none")
    return with_finetune(args, spec.model_copy(update={"lora": spec.lora.model_copy(update={"r": r})}))


def finetuned(workload: "Workload", raw: Any) -> "Workload":
    """`workload` fine-tuned as `raw` (a FineTune or its JSON form) says: its build_model freezes and adds LoRA
    adapters after the workload's own build. Checked here on a build on the meta device where the model builds
    there: SpecError where a freeze pattern or the LoRA targets match no module, or nothing is left to train.
    The result has no `decoder` shape, so it is traced, never costed by the decoder formulas, and runs on one
    device or data parallel (no tp, pp or cp layout). Its name says how it is tuned (name+lora, name+freeze)."""
    spec = finetune_of({FINETUNE_ARG: raw})
    if spec is None or spec.empty:
        return workload
    base_build, name = workload.build_model, workload.name

    def build_model() -> Any:
        return apply_finetune(base_build(), spec, name)

    _check_on_meta(base_build, spec, name)
    suffix = "+lora" if spec.lora is not None else "+freeze"
    return workload.model_copy(update={"name": name + suffix, "build_model": build_model, "decoder": None})


def apply_finetune(model: Any, spec: FineTune, name: str = "the model") -> Any:
    """Freeze the modules `spec.freeze` names, then add `spec.lora`'s adapters (peft's inject_adapter_in_model,
    in place: the model keeps its class, so the workload's loss_fn runs it as before). Returns the model,
    marked FROZEN_BASE."""
    for pattern in spec.freeze:
        matched = [m for qual, m in model.named_modules() if qual and fnmatch.fnmatchcase(qual, pattern)]
        if not matched:
            raise SpecError(f"freeze pattern {pattern!r} matches no module of {name}; its top-level modules: "
                            f"{_top_names(model)}")
        for module in matched:
            module.requires_grad_(False)
    if spec.lora is not None:
        model = _add_lora(model, spec.lora, name)
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError(f"the fine-tune leaves no parameter of {name} to train; freeze fewer modules")
    setattr(model, FROZEN_BASE, True)
    return model


def _add_lora(model: Any, lora: LoraSpec, name: str) -> Any:
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise SpecError("LoRA needs peft: pip install 'advisor[hf]'") from exc
    import warnings

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha if lora.alpha is not None else lora.r,
                        lora_dropout=lora.dropout, target_modules=list(lora.targets))
    try:
        with warnings.catch_warnings():  # peft's notes on partial matches: the check below is ours
            warnings.simplefilter("ignore")
            return inject_adapter_in_model(config, model)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError, or a target layer type it cannot adapt
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"LoRA targets {','.join(lora.targets)} on {name}: {first.split('. ')[0]}; its layers' "
                        f"names end in {_leaf_names(model)}") from exc


def _top_names(model: Any, limit: int = 12) -> str:
    names = [n for n, _ in model.named_children()]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") if names else "(none)"


def _leaf_names(model: Any, limit: int = 12) -> str:
    """The distinct last parts of the names of the model's modules that hold parameters, as peft matches them."""
    seen = list(dict.fromkeys(qual.rpartition(".")[2] for qual, m in model.named_modules()
                              if qual and any(True for _ in m.parameters(recurse=False))))
    return ", ".join(seen[:limit]) + (", ..." if len(seen) > limit else "") if seen else "(none)"


def _check_on_meta(build: Any, spec: FineTune, name: str) -> None:
    """`apply_finetune` on a build on the meta device, so bad patterns or targets fail before anything runs; a
    build that needs real storage is checked where it is built."""
    import torch

    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - the workload's own build: where it cannot run on meta, the real build checks
        return
    with torch.device("meta"):
        apply_finetune(model, spec, name)


def hold_frozen(model: Any, precision: Precision | str) -> Any:
    """A model `finetune` built (marked FROZEN_BASE) with its frozen floating-point parameters cast to bf16 in
    place under precision bf16 or bf16-pure, as a frozen base is loaded for fine-tuning (the adapters and other
    trained parameters keep fp32 master weights under bf16 autocast; bf16-pure casts them too). Any other model
    or precision: as it is. Called where the model is built, before it moves to its device, so the device holds
    only the bf16 copy. Returns the model."""
    if Precision(precision) not in (Precision.bf16, Precision.bf16_pure) or not getattr(model, FROZEN_BASE, False):
        return model
    import torch

    with torch.no_grad():
        for p in model.parameters():  # each parameter once: a tied weight is cast with its first owner
            if not p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
    return model


def add_finetune_args(p: "argparse.ArgumentParser") -> None:
    """The fine-tune's flags: --freeze, --lora, --lora-targets."""
    p.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="freeze the modules whose qualified name matches (fnmatch: blocks.0.*, *.attn, embed); "
                        "no gradient or optimizer state for them; repeatable")
    p.add_argument("--lora", default=None, metavar="r=R[,alpha=A][,dropout=P]",
                   help="train LoRA adapters (peft) on a frozen base, e.g. r=16,alpha=32 (alpha default r); needs "
                        "--lora-targets")
    p.add_argument("--lora-targets", default=None, metavar="NAME,NAME,...",
                   help="modules the adapters wrap, by the end of their names (peft's target_modules), e.g. "
                        "q_proj,v_proj")


def finetune_from_cli(args: "argparse.Namespace") -> FineTune | None:
    """The FineTune the flags of `add_finetune_args` ask for, or None; SpecError naming the flag at fault."""
    lora = None
    if args.lora_targets is not None and args.lora is None:
        raise SpecError("--lora-targets needs --lora (e.g. --lora r=16,alpha=32)")
    if args.lora is not None:
        if not args.lora_targets:
            raise SpecError("--lora needs --lora-targets: the modules the adapters wrap, e.g. q_proj,v_proj")
        fields: dict[str, Any] = {}
        for part in args.lora.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("r", "alpha", "dropout"):
                raise SpecError(f"--lora {args.lora!r}: {part!r} is not r=R, alpha=A or dropout=P")
            fields[key.strip()] = value.strip()
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        try:
            lora = LoraSpec(**fields, targets=targets)
        except ValidationError as exc:
            raise invalid_input(exc, {"r": "--lora r", "alpha": "--lora alpha", "dropout": "--lora dropout",
                                      "targets": "--lora-targets"}) from exc
    try:
        spec = FineTune(freeze=tuple(args.freeze), lora=lora)
    except ValidationError as exc:
        raise invalid_input(exc, {"freeze": "--freeze"}) from exc
    return None if spec.empty else spec


def cli_workload_args(args: "argparse.Namespace") -> dict[str, Any]:
    """The workload args of a command: its --workload-arg pairs, with the fine-tune its flags ask for."""
    from advisor.workload import parse_workload_args

    return with_finetune(parse_workload_args(args.workload_arg), finetune_from_cli(args))
