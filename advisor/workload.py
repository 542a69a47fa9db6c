"""The Workload contract (docs/design.md) and loading one from a preset name or `file.py:build`."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.errors import SpecError, WorkloadError


class DecoderArch(BaseModel):
    """Shape of a decoder-only transformer: what advisor.presets.decoders.Decoder builds and the analytic
    estimator counts (Korthikanti et al. 2022). Sizes are element counts; heads must divide hidden and
    kv_heads must divide heads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(gt=0)
    hidden: int = Field(gt=0, description="Model width d_model.")
    heads: int = Field(gt=0, description="Query heads; head dim = hidden / heads.")
    kv_heads: int = Field(gt=0, description="Key/value heads (grouped-query attention); = heads for MHA.")
    ffn_hidden: int = Field(gt=0, description="Width of the feed-forward inner layer.")
    vocab: int = Field(gt=0)
    seq_len: int = Field(gt=0, description="Tokens per sample (and the learned position table's length).")
    gated_ffn: bool = Field(description="SwiGLU (three matrices, no biases) instead of a two-matrix GELU MLP.")
    norm: Literal["layernorm", "rmsnorm"] = Field(description="LayerNorm (weight and bias) or RMSNorm (weight).")
    tied_embeddings: bool = Field(default=False, description="The output projection is the token embedding.")
    learned_positions: bool = Field(default=False, description="GPT-2 style position table (else RoPE).")
    bias: bool = Field(default=True, description="Biases on q, k, v, o and the GELU MLP (never on SwiGLU).")
    rope_theta: float = Field(default=500_000.0, gt=0, description="RoPE base (Llama 3); unused with learned "
                              "positions.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "DecoderArch":
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        return self


class Workload(BaseModel):
    """A model, a way to make a batch of a given size, and a loss: what the advisor trains.

    `make_batch(n)` returns CPU tensors (a tensor, or a tuple/list/dict of tensors);
    `loss_fn(model, batch)` runs forward and returns a scalar loss.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    dataset: Callable[[], Any] | None = None
    collate_fn: Callable | None = None
    tokens_per_sample: int | None = Field(default=None, gt=0)
    default_batch_size: int = Field(default=8, gt=0,
                                    description="The batch a user of this workload would start with (samples).")
    decoder: DecoderArch | None = Field(default=None,
                                        description="Set by decoder presets: enables the analytic estimator.")
    embedding_heavy: bool = Field(default=False, description="Embedding tables dominate the parameters (recommenders).")
    conv_net: bool = Field(default=False, description="A convolutional net (channels_last applies).")

    def build(self, batch: Callable[[int], Any] | None = None) -> Any:
        """`build_model()`, with its lazy modules' parameters made (nn.LazyLinear, LazyConv2d, ...: their shapes
        come from the first input) by one forward pass without gradients on a batch of 2 (`make_batch`, or
        `batch`), as torch's documentation tells a user to do before building an optimizer: the advisor builds
        the optimizer, so it makes them. Any other model is returned as built. A pass that fails is a
        WorkloadError naming the workload."""
        model = self.build_model()
        from torch.nn.modules.lazy import LazyModuleMixin

        if not any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in model.modules()):
            return model
        import torch

        try:
            with torch.no_grad():
                self.loss_fn(model, (batch or self.make_batch)(2))
        except Exception as exc:  # noqa: BLE001 - the user's forward: any error is theirs, said in one line
            raise WorkloadError(f"workload {self.name}: its lazy modules' parameters could not be made by a forward "
                                f"pass on a batch of 2: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return model


class WorkloadInfo(BaseModel):
    """What the advisor's own process needs of a workload, made where the workload's code runs (an isolated
    worker, advisor/isolation): its name, fingerprint and the attributes knobs and throughput depend on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    fingerprint: str = Field(description="advisor.fingerprint.workload_fingerprint of the workload.")
    tokens_per_sample: int | None = None
    default_batch_size: int = 8
    decoder: DecoderArch | None = None
    embedding_heavy: bool = False
    conv_net: bool = False
    has_dataset: bool = False
    dataset_samples: int | None = Field(default=None, description="len() of its dataset; None without one or a length.")

    @classmethod
    def of(cls, workload: Workload) -> "WorkloadInfo":
        """Fingerprint `workload` (builds it on the meta device) and read its dataset's length."""
        from advisor.fingerprint import workload_fingerprint

        return cls(name=workload.name, fingerprint=workload_fingerprint(workload),
                   tokens_per_sample=workload.tokens_per_sample, default_batch_size=workload.default_batch_size,
                   decoder=workload.decoder, embedding_heavy=workload.embedding_heavy, conv_net=workload.conv_net,
                   has_dataset=workload.dataset is not None, dataset_samples=dataset_length(workload))


def dataset_length(workload: Workload) -> int | None:
    """len() of the workload's dataset (samples); None when it has none or it has no length."""
    if workload.dataset is None:
        return None
    try:
        n = len(workload.dataset())
    except TypeError:  # an IterableDataset has no length
        return None
    return n if n > 0 else None


def describe_workload(spec: str, args: dict[str, Any] | None = None) -> WorkloadInfo:
    """Load `spec` and describe it (WorkloadInfo.of); run in an isolated worker, where its code may fail."""
    return WorkloadInfo.of(load_workload(spec, args))


# Which part of a user's workload runs now, for whoever watches (the isolated worker tells its parent,
# so a crash is named "the workload's loss crashed (SIGABRT)"); nothing is done where no one watches.
_watcher: ContextVar[Callable[[str | None], None] | None] = ContextVar("advisor_workload_part", default=None)
_parts: ContextVar[tuple[str, ...]] = ContextVar("advisor_workload_parts", default=())
PARTS = {"import": "the workload's import", "build": "the workload's build()", "model": "the workload's model",
         "make_batch": "the workload's make_batch", "loss": "the workload's loss", "dataset": "the workload's dataset",
         "collate": "the workload's collate_fn"}
FAILED_IN = "advisor_workload_part"  # the attribute an exception leaving a part carries: that part's name


@contextmanager
def watching_parts(callback: Callable[[str | None], None]) -> Iterator[None]:
    """Inside the block, `callback(part)` is told each time the innermost running part of a workload loaded
    here changes (a key of PARTS, or None when none runs)."""
    token = _watcher.set(callback)
    try:
        yield
    finally:
        _watcher.reset(token)


@contextmanager
def _part(name: str) -> Iterator[None]:
    watcher = _watcher.get()
    if watcher is None:
        yield
        return
    outer = _parts.get()
    token = _parts.set(outer + (name,))
    watcher(name)
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, FAILED_IN):  # the innermost part it left, for the failure's message
            setattr(exc, FAILED_IN, name)
        raise
    finally:
        _parts.reset(token)
        watcher(outer[-1] if outer else None)


def _watched(part: str, fn: Callable | None) -> Callable | None:
    if fn is None:
        return None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _part(part):
            return fn(*args, **kwargs)

    return call


def _with_parts(workload: Workload) -> Workload:
    """`workload` whose callables tell the watcher when they run (only where one watches)."""
    if _watcher.get() is None:
        return workload
    return workload.model_copy(update={
        "build_model": _watched("model", workload.build_model),
        "make_batch": _watched("make_batch", workload.make_batch),
        "loss_fn": _watched("loss", workload.loss_fn), "dataset": _watched("dataset", workload.dataset),
        "collate_fn": _watched("collate", workload.collate_fn)})


def parse_workload_args(pairs: list[str] | None, flag: str = "--workload-arg") -> dict[str, Any]:
    """Turn ['k=v', ...] into kwargs; values are parsed as JSON where they parse, else kept as strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"{flag} {pair!r} is not key=value")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _import_target(target: str) -> Callable[..., Any]:
    module_part, _, attr = target.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise WorkloadError(f"workload file {module_part} does not exist")
        mod_name = f"advisor_user_workload_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise WorkloadError(f"workload file {module_part} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            with _part("import"):
                spec.loader.exec_module(module)
        except Exception as exc:  # user's code: report it in one line
            raise WorkloadError(f"workload file {module_part} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            with _part("import"):
                module = importlib.import_module(module_part)
        except Exception as exc:
            raise WorkloadError(f"workload module {module_part} failed to import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise WorkloadError(f"{module_part} has no callable {attr!r}")
    return fn


def load_workload(spec: str, args: dict[str, Any] | None = None) -> Workload:
    """A preset name (`gpt2-small`), `path/to/file.py:build`, `pkg.module:build` or `hf:PATH` (a Hugging Face
    config.json, advisor/presets/hf.py) -> Workload."""
    args = args or {}
    from advisor.finetune import FINETUNE_ARG, finetuned

    if FINETUNE_ARG in args:  # a fine-tune (advisor/finetune.py) of the workload the other args build
        return finetuned(load_workload(spec, {k: v for k, v in args.items() if k != FINETUNE_ARG}), args[FINETUNE_ARG])
    if spec.startswith("hf:"):
        from advisor.presets.hf import hf_workload

        with _part("build"):
            return _with_parts(hf_workload(spec.removeprefix("hf:"), **args))
    if ":" not in spec:
        from advisor.presets import get_preset

        preset = get_preset(spec)
        with _part("build"):
            return _with_parts(preset(**args))
    build = _import_target(spec)
    try:
        with _part("build"):
            workload = build(**args)
    except Exception as exc:
        raise WorkloadError(f"{spec}: build() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{spec}: build() returned {type(workload).__name__}, not advisor.Workload")
    return _with_parts(workload)
