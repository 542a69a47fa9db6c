"""Hugging Face models as workloads (`-w hf:PATH`): a local config.json built by transformers, with no weights
and no hub, trained on synthetic batches with the model's own loss."""

from __future__ import annotations

import difflib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from advisor.errors import SpecError
from advisor.workload import DecoderArch, Workload

PREFIX = "hf:"
MISSING_EXTRA = "hf: workloads need the hf extra: pip install 'advisor[hf]'"
DEFAULT_SEQ_LEN = 512  # tokens per sample where the config's context is longer (or has no limit)
DEFAULT_BATCH = 8  # samples
SEED = 0


@dataclass(frozen=True)
class Task:
    """What a config's architecture is trained for: the auto class that builds it and its batch."""

    name: str
    auto_class: str  # transformers.AutoModelFor...
    suffixes: tuple[str, ...]  # of the architecture's class name
    tokens: bool  # its samples are seq_len token ids (else images)


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("causal-lm", "AutoModelForCausalLM", ("ForCausalLM", "LMHeadModel"), True),
    Task("masked-lm", "AutoModelForMaskedLM", ("ForMaskedLM",), True),
    Task("sequence-classification", "AutoModelForSequenceClassification", ("ForSequenceClassification",), True),
    Task("seq2seq", "AutoModelForSeq2SeqLM", ("ForConditionalGeneration",), True),
    Task("image-classification", "AutoModelForImageClassification", ("ForImageClassification",), False),
)}


def hf_workload(path: str, **args: Any) -> Workload:
    """The workload of the model a local config.json describes (PATH: the file, or a directory holding one).

    `args`: `seq_len` (tokens per sample; default the config's max positions, at most 512), every other key
    overrides that config key, its value coerced to the key's type (`num_hidden_layers=2`). The task comes from
    the config's `architectures` (TASKS); a batch of B is B rows of seq_len random token ids in [0, vocab_size)
    (images: B x num_channels x image_size^2 normal pixels), with labels of the task's shape: the ids themselves
    (causal and masked LM, and the decoder side of seq2seq) or a class in [0, num_labels). The loss is the
    model's own (`model(**batch).loss`), attention SDPA where the model supports it, else eager.
    Raises SpecError (one line) for a path that is not local, a missing extra, an uncovered architecture or a
    bad override."""
    seq_len = args.pop("seq_len", None)
    model = HFModel.load(path, args)
    return model.workload(seq_len)


def hf_decoder_arch(source: Workload | Any) -> DecoderArch | None:
    """The advisor's DecoderArch of the same shape, for a causal LM of the llama, mistral, qwen2, qwen3, gpt2 or
    gpt_neox family (an hf: workload, or a transformers config with a `seq_len` to give it); None for any other
    model or a head dim that is not hidden / heads."""
    seq_len = DEFAULT_SEQ_LEN
    if isinstance(source, Workload):
        built = inspect.unwrap(source.build_model)
        if not isinstance(built, HFModel) or built.task.name != "causal-lm":
            return None
        source, seq_len = built.config, source.tokens_per_sample or DEFAULT_SEQ_LEN
    family = FAMILIES.get(getattr(source, "model_type", None))
    if family is None:
        return None
    from pydantic import ValidationError

    c = source
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None)
    if head_dim is not None and head_dim * heads != c.hidden_size:
        return None
    try:
        return DecoderArch(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=heads,
                           kv_heads=getattr(c, "num_key_value_heads", None) or heads, vocab=c.vocab_size,
                           seq_len=seq_len, tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                           **family(c))
    except ValidationError:
        return None


def _swiglu(c: Any) -> dict[str, Any]:  # llama-like: RMSNorm, SwiGLU, RoPE
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(c, "rope_theta", None) or 10_000.0
    return dict(ffn_hidden=c.intermediate_size, gated_ffn=True, norm="rmsnorm", learned_positions=False,
                bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")), rope_theta=float(theta))


def _gpt2(c: Any) -> dict[str, Any]:  # LayerNorm, GELU MLP, learned positions, biases
    return dict(ffn_hidden=c.n_inner or 4 * c.hidden_size, gated_ffn=False, norm="layernorm",
                learned_positions=True, bias=True)


def _neox(c: Any) -> dict[str, Any]:  # LayerNorm, GELU MLP, rotary, biases
    return dict(ffn_hidden=c.intermediate_size, gated_ffn=False, norm="layernorm", learned_positions=False,
                bias=bool(getattr(c, "attention_bias", True)))


FAMILIES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "llama": _swiglu, "mistral": _swiglu, "qwen2": _swiglu, "qwen3": _swiglu, "gpt2": _gpt2, "gpt_neox": _neox}


class HFModel:
    """A config, its task and attention implementation; calling it builds the model (fp32, random weights)."""

    def __init__(self, config: Any, task: Task, label: str) -> None:
        self.config, self.task, self.label = config, task, label
        self.attn = "sdpa"

    @classmethod
    def load(cls, path: str, overrides: dict[str, Any]) -> "HFModel":
        """The config at `path` with `overrides` applied, checked by building its model on the meta device."""
        file = _config_file(path)
        _transformers()
        raw = _read_json(path, file)
        config = _with_overrides(path, raw, _config(path, file, raw), overrides)
        task = _task(path, config)
        _complete(config, task)
        label = file.parent.name if file.name == "config.json" else file.stem
        model = cls(config, task, label)
        model.check(path)
        return model

    def __call__(self) -> Any:
        import torch

        auto = getattr(_transformers(), self.task.auto_class)
        return auto.from_config(self.config, attn_implementation=self.attn, dtype=torch.float32,
                                trust_remote_code=False)

    def check(self, path: str) -> None:
        """Build on the meta device: a config transformers cannot build is a SpecError here, and a model that
        has no SDPA attention falls back to eager."""
        import torch

        for attn in ("sdpa", "eager"):
            self.attn = attn
            try:
                with torch.device("meta"):
                    self()
                return
            except Exception as exc:  # noqa: BLE001 - transformers' checks raise many kinds; each is one line here
                if attn == "sdpa" and "scaled_dot_product_attention" in str(exc):
                    continue
                raise SpecError(f"hf:{path}: transformers cannot build this config: {_line(exc)}") from exc

    def workload(self, seq_len: Any) -> Workload:
        """The Workload at `seq_len` tokens per sample (None: the default the module docstring gives)."""
        import torch

        c = self.config
        name = f"hf:{c.model_type}/{self.label}"
        make: Callable[[int], dict[str, Any]]
        gen = torch.Generator().manual_seed(SEED)
        if self.task.tokens:
            seq = _seq_len(name, c, seq_len)
            vocab = c.get_text_config().vocab_size
            make = _TOKEN_BATCHES[self.task.name](gen, seq, vocab, c)
        else:
            if seq_len is not None:
                raise SpecError(f"{name}: seq_len is for token models; {self.task.name} takes images "
                                "(override image_size instead)")
            seq, make = None, _images(gen, c)
        return Workload(name=name, build_model=self, make_batch=make, loss_fn=_own_loss, tokens_per_sample=seq,
                        default_batch_size=DEFAULT_BATCH)


def _own_loss(model: Any, batch: dict[str, Any]) -> Any:
    return model(**batch).loss


def _ids(gen: Any, n: int, seq: int, vocab: int) -> Any:
    import torch

    return torch.randint(0, vocab, (n, seq), generator=gen)  # (B, T) int64


def _same_ids(gen: Any, seq: int, vocab: int, c: Any) -> Callable[[int], dict[str, Any]]:
    def make(n: int) -> dict[str, Any]:  # next-token or masked-token targets: the ids themselves
        ids = _ids(gen, n, seq, vocab)
        return {"input_ids": ids, "labels": ids.clone()}
    return make


def _seq2seq(gen: Any, seq: int, vocab: int, c: Any) -> Callable[[int], dict[str, Any]]:
    def make(n: int) -> dict[str, Any]:  # encoder ids and decoder-side labels, both (B, T)
        return {"input_ids": _ids(gen, n, seq, vocab), "labels": _ids(gen, n, seq, vocab)}
    return make


def _classes(gen: Any, seq: int, vocab: int, c: Any) -> Callable[[int], dict[str, Any]]:
    import torch

    def make(n: int) -> dict[str, Any]:  # one label per sample; a single label is a regression target
        labels = torch.randn(n, generator=gen) if c.num_labels == 1 else torch.randint(0, c.num_labels, (n,),
                                                                                       generator=gen)
        return {"input_ids": _ids(gen, n, seq, vocab), "labels": labels}
    return make


_TOKEN_BATCHES = {"causal-lm": _same_ids, "masked-lm": _same_ids, "seq2seq": _seq2seq,
                  "sequence-classification": _classes}


def _images(gen: Any, c: Any) -> Callable[[int], dict[str, Any]]:
    import torch

    size = c.image_size if isinstance(c.image_size, (list, tuple)) else (c.image_size, c.image_size)

    def make(n: int) -> dict[str, Any]:  # pixel_values (B, C, H, W), one class per sample
        return {"pixel_values": torch.randn(n, c.num_channels, *size, generator=gen),
                "labels": torch.randint(0, c.num_labels, (n,), generator=gen)}
    return make


def _transformers() -> Any:
    # The hub is never reached: a config is read from a local path, and nothing else is fetched.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise SpecError(MISSING_EXTRA) from exc
    return transformers


def _config_file(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SpecError(f"hf:{path}: the directory has no config.json")
        return p / "config.json"
    if p.is_file():
        return p
    raise SpecError(f"hf:{path}: no such local file or directory, and the hub is not reached; download the "
                    "model's config.json and pass its local path (-w hf:path/to/config.json)")


def _read_json(path: str, file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"hf:{path}: not a readable JSON config: {_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"hf:{path}: a config.json holds a JSON object, got {type(raw).__name__}")
    return raw


def _config(path: str, file: Path, raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - the config's validators raise many kinds; each is one line here
        raise SpecError(f"hf:{path}: transformers cannot read this config (model_type "
                        f"{raw.get('model_type')!r}): {_line(exc)}") from exc


def _with_overrides(path: str, raw: dict[str, Any], config: Any, overrides: dict[str, Any]) -> Any:
    """The config rebuilt from the file's keys with `overrides` (coerced to each key's type) in place, so what
    the config derives from them at construction (per-layer lists, head dims) follows."""
    if not overrides:
        return config
    known = config.to_dict()
    keys = sorted(set(known) | set(config.attribute_map))
    updated = dict(raw)
    for key, value in overrides.items():
        if key not in known and key not in config.attribute_map:
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
            hint = f"close config keys: {', '.join(close)}" if close else "-a seq_len=N or a key of the config"
            raise SpecError(f"hf:{path}: {key!r} is not a key of this {config.model_type} config; {hint}")
        canon = config.attribute_map.get(key, key)
        updated[canon] = _coerce(path, key, value, known.get(canon))
    layers = config.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    _per_layer(updated, known.get(layers), updated.get(layers))
    try:
        return type(config).from_dict(updated)
    except Exception as exc:  # noqa: BLE001 - the config's validators raise many kinds; each is one line here
        raise SpecError(f"hf:{path}: the overridden config is not valid: {_line(exc)}") from exc


def _per_layer(raw: dict[str, Any], old: Any, new: Any) -> None:
    """Lists with one entry per layer (layer_types, ...) follow a changed layer count, repeating their pattern."""
    if not isinstance(old, int) or not isinstance(new, int) or old == new:
        return
    for key, value in raw.items():
        if isinstance(value, list) and len(value) == old and old > 0:
            raw[key] = [value[i % old] for i in range(new)]


def _coerce(path: str, key: str, value: Any, current: Any) -> Any:
    """`value` (a string, or a scalar parsed from JSON) as the type of the config's `current` value."""
    def bad() -> SpecError:
        return SpecError(f"hf:{path}: -a {key}={value!r}: {key} takes type {type(current).__name__} "
                         f"(the config has {current!r})")

    if current is None:
        return value
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise bad()
        return value
    if isinstance(current, (int, float)):
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise bad() from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise bad()
        if isinstance(current, int):
            if number != int(number):
                raise bad()
            return int(number)
        return float(number)
    if isinstance(current, str):
        return value if isinstance(value, str) else json.dumps(value)
    if not isinstance(value, type(current)):
        raise bad()
    return value


def _task(path: str, config: Any) -> Task:
    found = list(getattr(config, "architectures", None) or [])
    for arch in found:
        for task in TASKS.values():
            if arch.endswith(task.suffixes) and (task.name != "seq2seq" or config.is_encoder_decoder):
                return task
    covered = ", ".join(f"{t.name} (*{'/*'.join(t.suffixes)})" for t in TASKS.values())
    what = f"architectures {found}" if found else "no architectures"
    raise SpecError(f"hf:{path}: the config has {what}; covered: {covered}")


def _complete(config: Any, task: Task) -> None:
    """Token ids a task's loss needs that a config may leave unset: the pad id (classification of a batch of
    more than one, seq2seq's label shift) and the decoder's start id."""
    if task.name in ("sequence-classification", "seq2seq") and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    if task.name == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id


def _seq_len(name: str, config: Any, seq_len: Any) -> int:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if seq_len is None:
        return min(limit, DEFAULT_SEQ_LEN) if isinstance(limit, int) and limit > 0 else DEFAULT_SEQ_LEN
    if isinstance(seq_len, str) and seq_len.isdigit():
        seq_len = int(seq_len)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise SpecError(f"{name}: seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(limit, int) and seq_len > limit:
        raise SpecError(f"{name}: seq_len={seq_len} is over the config's {limit} positions; raise them with "
                        f"-a max_position_embeddings={seq_len}")
    return seq_len


def _line(exc: BaseException) -> str:
    """The first line of the error that started `exc` (a validator's ValueError, not the wrapper around it)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
