"""A fine-tune (advisor/finetune.py) as the planner counts it: its freeze patterns and LoRA targets mapped onto the
parts of the analytic decoder (parallel_tuned.Tuning), by the module names of the model a trial builds.

Freeze patterns match whole qualified module names as `model.named_modules()` gives them (fnmatch), and a match
freezes everything under it: the advisor's decoder names its modules blocks.N.attn.wq, tok_embeddings, norm,
output; a Hugging Face config's model has its family's names (model.layers.N.self_attn.q_proj, lm_head), and an
hf: workload takes either. LoRA targets match as peft's target_modules do (a module whose name is the target or
ends with "." and it), against the advisor's names and, for an hf: config, its family's, so q_proj and wq both
name its query projection; a preset takes the advisor's names only, as its trial does.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from advisor.errors import SpecError
from advisor.estimate.parallel_tuned import Tuning
from advisor.finetune import FineTune
from advisor.workload import DecoderArch

ROOT_ROLES = frozenset({"tok_embeddings", "pos_embeddings", "norm", "output"})
LINEAR_ROLES = frozenset({"wq", "wk", "wv", "wo", "w1", "w2", "w3", "fc", "proj", "output"})


@dataclass(frozen=True)
class Leaf:
    """A module holding parameters: its qualified name, its block (None: the root) and the roles it holds."""

    name: str
    layer: int | None
    roles: tuple[str, ...]


# Each family's module names: the root's (role, name), and a block's (roles, name below the block's prefix)
_ADVISOR_GATED = (("attn_norm",), "attn_norm"), (("wq",), "attn.wq"), (("wk",), "attn.wk"), (("wv",), "attn.wv"), \
    (("wo",), "attn.wo"), (("ffn_norm",), "ffn_norm"), (("w1",), "ffn.w1"), (("w3",), "ffn.w3"), (("w2",), "ffn.w2")
_ADVISOR_GELU = _ADVISOR_GATED[:6] + ((("fc",), "ffn.fc"), (("proj",), "ffn.proj"))
_LLAMA = (("attn_norm",), "input_layernorm"), (("wq",), "self_attn.q_proj"), (("wk",), "self_attn.k_proj"), \
    (("wv",), "self_attn.v_proj"), (("wo",), "self_attn.o_proj"), (("ffn_norm",), "post_attention_layernorm"), \
    (("w1",), "mlp.gate_proj"), (("w3",), "mlp.up_proj"), (("w2",), "mlp.down_proj")
_GPT2 = (("attn_norm",), "ln_1"), (("wq", "wk", "wv"), "attn.c_attn"), (("wo",), "attn.c_proj"), \
    (("ffn_norm",), "ln_2"), (("fc",), "mlp.c_fc"), (("proj",), "mlp.c_proj")
_NEOX = (("attn_norm",), "input_layernorm"), (("wq", "wk", "wv"), "attention.query_key_value"), \
    (("wo",), "attention.dense"), (("ffn_norm",), "post_attention_layernorm"), (("fc",), "mlp.dense_h_to_4h"), \
    (("proj",), "mlp.dense_4h_to_h")
# family: (block prefix, block modules, root modules, gated FFN)
FAMILIES = {
    "advisor": ("blocks", None, (("tok_embeddings", "tok_embeddings"), ("pos_embeddings", "pos_embeddings"),
                                 ("norm", "norm"), ("output", "output")), None),
    "llama": ("model.layers", _LLAMA, (("tok_embeddings", "model.embed_tokens"), ("norm", "model.norm"),
                                      ("output", "lm_head")), True),
    "gpt2": ("transformer.h", _GPT2, (("tok_embeddings", "transformer.wte"), ("pos_embeddings", "transformer.wpe"),
                                      ("norm", "transformer.ln_f"), ("output", "lm_head")), False),
    "gpt_neox": ("gpt_neox.layers", _NEOX, (("tok_embeddings", "gpt_neox.embed_in"),
                                            ("norm", "gpt_neox.final_layer_norm"), ("output", "embed_out")), False),
}
MODEL_TYPES = {"advisor": "advisor", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
               "gpt2": "gpt2", "gpt_neox": "gpt_neox"}


def leaves(arch: DecoderArch, family: str) -> list[Leaf]:
    """The modules with parameters of `family`'s model of `arch`'s shape ("advisor": advisor.presets.decoders)."""
    prefix, block, root, _ = FAMILIES[family]
    if block is None:
        block = _ADVISOR_GATED if arch.gated_ffn else _ADVISOR_GELU
    out = [Leaf(f"{prefix}.{i}.{name}", i, roles) for i in range(arch.layers) for roles, name in block]
    # a tied output Linear is still a module (its weight the embedding's)
    out += [Leaf(name, None, (role,)) for role, name in root if role != "pos_embeddings" or arch.learned_positions]
    return out


def tuning_of(spec: FineTune | None, arch: DecoderArch, model_type: str | None = None,
              name: str = "the model") -> Tuning | None:
    """`spec` on `arch` as the analytic model counts it; None where `spec` is None or empty. `model_type`: a
    Hugging Face config's (its family's names then name modules too), "advisor" (a preset's model: the advisor's
    names only, as its trial takes them), or None (a model whose names are not known: any family's of its
    shape). SpecError, one line, for a pattern that matches no module, a LoRA target that names no Linear of the
    decoder, or a fine-tune that leaves nothing to train."""
    if spec is None or spec.empty:
        return None
    family = MODEL_TYPES.get(model_type or "")
    names = leaves(arch, "advisor") + (leaves(arch, family) if family not in (None, "advisor") else [])
    frozen: list[set[str]] = [set() for _ in range(arch.layers)]
    root: set[str] = set() if arch.learned_positions else {"pos_embeddings"}  # absent: nothing of it trains
    for pattern in spec.freeze:
        _freeze(pattern, names, frozen, root, name)
    if arch.tied_embeddings and root & {"tok_embeddings", "output"}:  # one tensor: frozen through either module
        root |= {"tok_embeddings", "output"}
    tuning = Tuning(frozen=tuple(map(frozenset, frozen)), frozen_root=frozenset(root))
    if spec.lora is not None:
        sites, head = _targets(spec.lora.targets, arch, family, name)
        every = frozenset(role for leaf in leaves(arch, "advisor") if leaf.layer == 0 for role in leaf.roles)
        tuning = Tuning(frozen=(every,) * arch.layers, frozen_root=ROOT_ROLES, adapters=sites, head_adapter=head,
                        r=spec.lora.r, dropout=spec.lora.dropout > 0)
    elif root >= ROOT_ROLES and all(f >= _block_roles(arch) for f in frozen):
        raise SpecError(f"the fine-tune leaves no parameter of {name} to train; freeze fewer modules")
    return tuning


def _block_roles(arch: DecoderArch) -> set[str]:
    return {role for leaf in leaves(arch, "advisor") if leaf.layer == 0 for role in leaf.roles}


def _freeze(pattern: str, names: list[Leaf], frozen: list[set[str]], root: set[str], name: str) -> None:
    """Freeze what `pattern` names: every leaf at or below a module whose qualified name it matches."""
    modules = {leaf.name.rsplit(".", k)[0] for leaf in names for k in range(leaf.name.count(".") + 1)}
    matched = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
    if not matched:
        tops = sorted({m.split(".")[0] for m in modules})
        raise SpecError(f"freeze pattern {pattern!r} matches no module of {name}; its modules are named like "
                        f"{', '.join(_examples(names))} (top level: {', '.join(tops)})")
    for leaf in names:
        if any(leaf.name == m or leaf.name.startswith(m + ".") for m in matched):
            (frozen[leaf.layer] if leaf.layer is not None else root).update(leaf.roles)


def _examples(names: list[Leaf]) -> list[str]:
    return list(dict.fromkeys(leaf.name for leaf in names if leaf.layer in (None, 0)))[:6]


def _targets(targets: tuple[str, ...], arch: DecoderArch, family: str | None,
             name: str) -> tuple[tuple[tuple[tuple[str, ...], ...], ...], bool]:
    """(each block's adapters, each the roles it wraps; an adapter on the output layer) for LoRA `targets`."""
    gated = arch.gated_ffn
    families = ["advisor"] + ([family] if family else [f for f, spec in FAMILIES.items() if spec[3] == gated])
    names = [leaf for f in dict.fromkeys(families) for leaf in leaves(arch, f)]
    sites: list[dict[tuple[str, ...], None]] = [{} for _ in range(arch.layers)]
    head = False
    for target in targets:
        hits = [leaf for leaf in names if leaf.name == target or leaf.name.endswith("." + target)]
        if not hits or any(not set(leaf.roles) <= LINEAR_ROLES for leaf in hits):
            raise SpecError(f"LoRA target {target!r} {'is not a Linear' if hits else 'matches no Linear'} of "
                            f"{name}; the planner counts adapters on its Linears: {_allowed(arch, families)}")
        for leaf in hits:
            if leaf.layer is None:
                head = True
            else:
                sites[leaf.layer][leaf.roles] = None
    return tuple(tuple(s) for s in sites), head


def _allowed(arch: DecoderArch, families: list[str]) -> str:
    """The last parts of the Linears' names, by family."""
    out = []
    for f in dict.fromkeys(families):
        ends = dict.fromkeys(leaf.name.rsplit(".", 1)[-1] for leaf in leaves(arch, f)
                             if set(leaf.roles) <= LINEAR_ROLES)
        out.append(("" if f == "advisor" else f"{f}: ") + ", ".join(ends))
    return "; ".join(out)
