"""A fine-tune of a decoder as the analytic model counts it (Tuning), and its pipeline stage's figures
(parallel_analytic.py's): frozen parameters held in their own dtype with no gradient, optimizer state or
reduction; LoRA adapters (A of r x in, B of out x r) trained; and the tensors autograd keeps, which change with
what trains.

What a fine-tune changes in what a block saves (bytes per token, the module docstring of parallel_analytic.py for
the rest): a frozen Linear keeps no input (its backward needs only its weight), so a norm's output is kept only
for the trained projections and adapters reading it, and the FFN's last input only where its weight or an adapter
needs it; a frozen RMSNorm keeps no normalised x (h fp32). Where nothing before a block trains (frozen embeddings
and blocks), its input needs no gradient and its ops keep nothing until something trains. Each adapter keeps its
input (its own cast under autocast: peft casts the input to the adapter's fp32 and autocast back; under dropout
its output, and its mask where the input needs a gradient: 1 byte on CUDA, the scaled noise in the adapter's
dtype on a CPU), and A's r-wide output for B's gradient. Under bf16 the frozen embedding's output is bf16
(advisor.finetune.hold_frozen), so the residual stream is too; autocast still runs the norms in fp32, so each
trained projection keeps its own bf16 cast of a norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.config import Checkpointing, Strategy
from advisor.estimate.parallel_moments import F32, RankDims, StageFigures
from advisor.parallel.layout import Layout
from advisor.workload import DecoderArch

Shape = tuple[int, int]  # (dim 0, elements per dim-0 row)


@dataclass(frozen=True)
class Tuning:
    """What of a decoder trains under a fine-tune (advisor/finetune.py), by the analytic model's parts. Block roles:
    attn_norm, wq, wk, wv, wo, ffn_norm and w1, w3, w2 (SwiGLU) or fc, proj (GELU), a linear's bias with it; root
    roles: tok_embeddings, pos_embeddings, norm, output. A LoRA adapter wraps one linear, or a fused one whose
    output is several roles' (q|k|v): A of r x in, B of out x r, trained."""

    frozen: tuple[frozenset[str], ...]  # per layer, the block roles whose parameters are frozen
    frozen_root: frozenset[str]  # the root roles frozen
    adapters: tuple[tuple[tuple[str, ...], ...], ...] = ()  # per layer, each adapter's roles; () none
    head_adapter: bool = False  # an adapter on the output layer
    r: int = 0  # the adapters' rank
    dropout: bool = False  # the adapters' dropout keeps its mask and output for backward

    def layer_adapters(self, layer: int) -> tuple[tuple[str, ...], ...]:
        return self.adapters[layer] if self.adapters else ()

    def embeddings_frozen(self) -> bool:
        """Nothing before the first block trains: the embeddings' output needs no gradient."""
        return {"tok_embeddings", "pos_embeddings"} <= self.frozen_root


ATTENTION_INPUT = ("wq", "wk", "wv")  # the Linears reading the attention norm's output


def block_parts(arch: DecoderArch, t: int) -> list[tuple[str, Shape]]:
    """One block's parameters on one tp rank, each with its role: parallel_analytic._block_shapes's, in its
    order."""
    h, f = arch.hidden, arch.ffn_hidden // t
    q, kv = h // t, arch.kv_heads * (h // arch.heads) // t
    parts = [("wq", (q, h)), ("wk", (kv, h)), ("wv", (kv, h)), ("wo", (h, q))]
    if arch.bias:
        parts += [("wq", (q, 1)), ("wk", (kv, 1)), ("wv", (kv, 1)), ("wo", (h, 1))]
    if arch.gated_ffn:
        parts += [("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f))]
    else:
        parts += [("fc", (f, h)), ("proj", (h, f))] + ([("fc", (f, 1)), ("proj", (h, 1))] if arch.bias else [])
    norm = [(arch.hidden, 1)] * (1 if arch.norm == "rmsnorm" else 2)
    return parts + [("attn_norm", s) for s in norm] + [("ffn_norm", s) for s in norm]


def linear_io(arch: DecoderArch, t: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of a block's Linears on one tp rank."""
    h, f = arch.hidden, arch.ffn_hidden // t
    q, kv = h // t, arch.kv_heads * (h // arch.heads) // t
    ffn = {"w1": (h, f), "w3": (h, f), "w2": (f, h)} if arch.gated_ffn else {"fc": (h, f), "proj": (f, h)}
    return {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), **ffn}


def adapter_shapes(sites: tuple[tuple[str, ...], ...], io: dict[str, tuple[int, int]], r: int) -> tuple[Shape, ...]:
    """A (r x in) and B (out x r) of each adapter; a fused site's out is its roles' together."""
    out: list[Shape] = []
    for roles in sites:
        out += [(r, io[roles[0]][0]), (sum(io[x][1] for x in roles), r)]
    return tuple(out)


def tuned_stage(arch: DecoderArch, layout: Layout, d: RankDims, index: int, checkpointing: Checkpointing,
                tuning: Tuning) -> StageFigures:
    """Stage `index`'s figures under `tuning` (parallel_analytic._stage's, StageFigures' fields)."""
    from advisor.estimate.parallel_analytic import (
        _block_backward,
        _embedding_rows,
        _ends_saved,
        _loss_extra,
        _norm_saved,
        _norm_shapes,
        logits,
    )

    sizes = layout.split(arch.layers)
    start, layers = sum(sizes[:index]), sizes[index]
    first, last = index == 0, index == layout.stages - 1
    io, parts, h = linear_io(arch, d.t), block_parts(arch, d.t), arch.hidden
    linear_roles = set(io)
    trained, frozen, linear = [], [], 0
    for layer in range(start, start + layers):
        off = tuning.frozen[layer]
        adapters = adapter_shapes(tuning.layer_adapters(layer), io, tuning.r)
        trained.append(tuple(s for role, s in parts if role not in off) + adapters)
        frozen.append(tuple(s for role, s in parts if role in off))
        # autocast casts and caches the trained Linears' weights; a frozen fp32 weight's cast is kept for backward
        # alike (bf16 frozen weights need none)
        linear += sum(a * b for role, (a, b) in parts if role in linear_roles
                      and (role not in off or d.pf != d.c)) + sum(a * b for a, b in adapters)
    rows = -(-arch.vocab // d.t)
    root: list[tuple[str, Shape]] = []
    if first:
        root.append(("tok_embeddings", (rows, h)))
        if arch.learned_positions:
            root.append(("pos_embeddings", (-(-arch.seq_len // d.t), h)))
    if last:
        root += [("norm", s) for s in _norm_shapes(arch)]
        if not (first and arch.tied_embeddings):
            root.append(("output", (rows, h)))
    root_trained = tuple(s for role, s in root if role not in tuning.frozen_root)
    root_frozen = tuple(s for role, s in root if role in tuning.frozen_root)
    head_adapter = adapter_shapes((("output",),), {"output": (h, rows)}, tuning.r) \
        if last and tuning.head_adapter else ()
    output_trains = last and "output" not in tuning.frozen_root
    linear += (rows * h * (output_trains or d.pf != d.c) + sum(a * b for a, b in head_adapter)) * last
    root_trained += head_adapter
    grouped = layers >= 2
    units = (*trained, root_trained) if grouped else (sum(trained, ()) + root_trained,)
    frozen_units = (*frozen, root_frozen) if grouped else (sum(frozen, ()) + root_frozen,)

    flows = _flows_into(arch, d, tuning, start)
    checkpointed = checkpointing == Checkpointing.full and grouped
    saved, kept, full = 0, [], []
    for layer in range(start, start + layers):
        block, after = layer_saved(arch, d, tuning, layer, flows)
        if checkpointing == Checkpointing.selective and grouped and block:  # SDPA's logsumexp recomputed
            block -= d.b * d.T * arch.heads // d.t * F32
        keep = d.b * d.s * h * d.r * (flows or after) if checkpointed else block  # a checkpoint keeps its input
        saved, flows = saved + keep, after
        kept.append(keep)
        full.append(block)
    # the head's tensors as full training keeps them (parallel_analytic._ends_saved), replaced by the fine-tune's
    plain = (d.b * d.s * _norm_saved(arch, d) + d.b * d.T * h * (d.c if d.autocast else d.r)
             + logits(arch, d) * (F32 + (d.c if d.pp else 0))) * last
    head = head_saved(arch, d, tuning, flows) if last else 0
    saved += _ends_saved(arch, d, first, last, checkpointed) - plain + head
    head -= (plain - (_ends_saved(arch, d, False, True) - _ends_saved(arch, d, False, False))) * last
    recompute = max(full, default=0) if checkpointed else 0
    ffn = ("w1", "w3", "w2") if arch.gated_ffn else ("fc", "proj")
    weights = any(x not in tuning.frozen[start + layers - 1] for x in ffn) if layers else False
    output, loss, head_bwd = _loss_extra(arch, d) if last else (0, 0, 0)
    embeddings = _embedding_rows(arch, first)
    tables = [(role, n) for role, n in zip(("tok_embeddings", "pos_embeddings"), embeddings)]
    embed_grad = sum(n for role, n in tables if role not in tuning.frozen_root) * h * d.pw
    local_tables = sum(a * b for role, (a, b) in root[: len(embeddings)] if role not in tuning.frozen_root)
    rope = 0 if arch.learned_positions else 2 * d.T * (h // arch.heads) * F32
    per_layer = kept[0] if kept else 0
    return StageFigures(
        first=first, last=last, layers=layers, units=units, frozen_units=frozen_units,
        linear=linear, block_linear=linear // max(layers, 1),
        block_bytes=sum(a * b for a, b in trained[0]) * d.pw if trained else 0,
        largest=max([a * b for a, b in trained[0] if b > 1] * (layers > 0) + [rows * h * last], default=0) * d.pw,
        saved=saved, per_layer=per_layer, first_block=per_layer * (layers > 0) + rope,
        output_extra=output, loss_extra=loss, head_bwd=head_bwd,
        block_bwd=(recompute + _block_backward(arch, d, True, weights),
                   recompute + _block_backward(arch, d, False, weights)),
        log_softmax=logits(arch, d) * F32 * last, head=head,
        head_grad=rows * h * d.pw * output_trains,
        embed_grad=embed_grad, grad_extra=embed_grad - local_tables * d.pw)


def _flows_into(arch: DecoderArch, d: RankDims, tuning: Tuning, layer: int) -> bool:
    """Whether the input of block `layer` needs a gradient: something before it trains."""
    flows = not tuning.embeddings_frozen()
    for i in range(layer):
        flows = layer_saved(arch, d, tuning, i, flows)[1]
    return flows


def layer_saved(arch: DecoderArch, d: RankDims, tuning: Tuning, layer: int, flows: bool) -> tuple[int, bool]:
    """(bytes block `layer` saves for backward per micro-batch, whether its output needs a gradient), its input
    needing one where `flows` (module docstring)."""
    h, f, t = arch.hidden, arch.ffn_hidden // d.t, d.t
    tokens, local = d.b * d.T, d.b * d.s
    off, sites = tuning.frozen[layer], tuning.layer_adapters(layer)
    adapted = {role for site in sites for role in site}

    def trains(role: str) -> bool:
        return role not in off

    def grows(roles: tuple[str, ...]) -> bool:  # an output that needs a gradient: a trained weight or an adapter
        return any(trains(x) or x in adapted for x in roles)

    out = _norm(arch, d, local, flows, trains("attn_norm"))
    normed = flows or trains("attn_norm")
    attn_sites = [s for s in sites if s[0] in ATTENTION_INPUT]
    out += _inputs(d, tokens, h, _normed(d, trains("attn_norm")), sum(map(trains, ATTENTION_INPUT)),
                   len(attn_sites), tuning.dropout, False, grad=normed)
    qkv = normed or grows(ATTENTION_INPUT)
    if qkv:  # q, k, v into attention, its output and fp32 logsumexp, as parallel_analytic._layer_saved counts them
        kv = arch.kv_heads * (h // arch.heads) // t
        qkvo = 4 * h // t if not d.ring else 2 * h // t + 2 * kv
        out += tokens * (qkvo * d.c + arch.heads // t * F32)
    wo_sites = sum(s[0] == "wo" for s in sites)
    out += _inputs(d, tokens, h // t, d.c, trains("wo") * (not qkv), wo_sites, tuning.dropout, kept=qkv, grad=qkv)
    mixed = flows or qkv or grows(("wo",))
    out += _norm(arch, d, local, mixed, trains("ffn_norm"))
    first_roles, last_role = (("w1", "w3"), "w2") if arch.gated_ffn else (("fc",), "proj")
    ffn_sites = [s for s in sites if s[0] in first_roles]
    out += _inputs(d, tokens, h, _normed(d, trains("ffn_norm")), sum(map(trains, first_roles)), len(ffn_sites),
                   tuning.dropout, False, grad=mixed or trains("ffn_norm"))
    inner = mixed or trains("ffn_norm") or grows(first_roles)
    # SwiGLU keeps silu's input, its output and w3's output; GELU its input; the product (the activation) only
    # where the last matrix's weight or an adapter reads it
    out += tokens * (3 if arch.gated_ffn else 1) * f * d.c * inner
    last_sites = sum(s[0] == last_role for s in sites)
    out += tokens * f * d.c * trains(last_role)
    out += _inputs(d, tokens, f, d.c, 0, last_sites, tuning.dropout, kept=trains(last_role), grad=inner)
    out += len(sites) * tokens * tuning.r * d.c  # each adapter's A output, B's input
    return out, mixed or inner or grows((last_role,))


def _inputs(d: RankDims, tokens: int, width: int, elt: int, linears: int, adapters: int, dropout: bool,
            kept: bool, grad: bool) -> int:
    """Bytes kept of one input tensor (`width` features of `elt` bytes) read by `linears` trained Linears and
    `adapters` LoRA adapters; `kept`: the tensor itself is kept already. Under autocast each Linear keeps its own
    cast of an input in another dtype; an adapter keeps its own cast where its weights are not in the compute
    dtype; otherwise they share the tensor. Dropout keeps each adapter's output, and its mask where the input
    needs a gradient (`grad`): CUDA's fused dropout a 1-byte mask, a CPU's the noise it scales by, in the
    adapter's dtype (peft casts its input to it)."""
    read = tokens * width * (d.c if d.autocast else elt)
    own = d.autocast and elt != d.c
    out = linears * read if own else read * (linears > 0)
    shared = linears > 0 and not own or kept
    for _ in range(adapters):
        if d.autocast and d.pw != d.c:
            out += tokens * width * d.c
        elif dropout:
            out += tokens * width * elt
        elif not shared:
            out, shared = out + read, True
        out += tokens * width * (dropout and grad) * (d.pw if d.gloo else 1)
    return out


def _norm(arch: DecoderArch, d: RankDims, local: int, flows: bool, trains: bool) -> int:
    """Bytes a norm saves (parallel_analytic._norm_saved's) where its input needs a gradient; a frozen RMSNorm
    keeps no normalised x (its weight's gradient would read it), and one whose input needs none keeps only that
    (LayerNorm's fused kernel keeps its input and statistics either way)."""
    from advisor.estimate.parallel_analytic import _norm_saved

    if not (flows or trains):
        return 0
    if arch.norm == "layernorm":  # autocast runs it in fp32, on an fp32 copy of its input
        return local * (arch.hidden * (F32 if d.autocast else d.r) + 2 * F32)
    if not flows:
        return local * arch.hidden * _normed(d, trains)
    return local * (_norm_saved(arch, d) - arch.hidden * F32 * (not trains))


def _normed(d: RankDims, trains: bool) -> int:
    """Bytes per element of a norm's output: fp32 under autocast (CUDA's runs both norms in fp32), else the
    residual's dtype promoted by the weight's."""
    return F32 if d.autocast else max(d.r, d.pw if trains else d.pf)


def head_saved(arch: DecoderArch, d: RankDims, tuning: Tuning, flows: bool) -> int:
    """Bytes the final norm, the output layer (and its adapter) and the loss keep per micro-batch (the last
    stage's `head`)."""
    from advisor.estimate.parallel_analytic import logits

    tokens, local = d.b * d.T, d.b * d.s
    trains = "output" not in tuning.frozen_root
    out = _norm(arch, d, local, flows, "norm" not in tuning.frozen_root)
    out += _inputs(d, tokens, arch.hidden, _normed(d, "norm" not in tuning.frozen_root), int(trains),
                   int(tuning.head_adapter), tuning.dropout, False, grad=flows or "norm" not in tuning.frozen_root)
    out += tokens * tuning.r * d.c * tuning.head_adapter
    return out + logits(arch, d) * (F32 + (d.c if d.pp else 0))  # this rank's vocab / tp of them


def tuned_data_comm(layout: Layout, d: RankDims, stages: list[StageFigures], pp_rank: int,
                    grad_accum: int = 1) -> dict[str, dict[str, int]]:
    """parallel_comm._data_comm's payloads where parameters are frozen: DDP all-reduces (and ZeRO-1 broadcasts)
    the trained parameters only; FSDP2 gathers every parameter, frozen ones in their dtype, and reduce-scatters the
    trained ones' gradients."""
    from advisor.estimate.parallel_analytic import _gathers, gathering_batches
    from advisor.estimate.parallel_moments import _elements

    if layout.grad_ranks <= 1:
        return {}
    trained = sum(_elements(u) for st in stages for u in st.units) * d.pw
    if layout.strategy in (Strategy.ddp, Strategy.zero1):
        dp = {"all_reduce": trained} | ({"broadcast": trained} if layout.strategy == Strategy.zero1 else {})
        return {"dp": {k: v for k, v in dp.items() if v}}
    n = layout.fsdp_shards
    grads = [sum(_elements(u, n) for u in st.units) * d.pw for st in stages]
    params = [g + sum(_elements(u, n) for u in st.frozen_units) * d.pf for g, st in zip(grads, stages)]
    gathers = _gathers(layout, pp_rank, len(stages))
    out = {"dp": {"all_gather": gathering_batches(layout, grad_accum) * sum(g * p for g, p in zip(gathers, params)),
                  "reduce_scatter": sum(grads)}}
    if layout.dp_replicate > 1:
        out["replicate"] = {"all_reduce": sum(grads) // n}
    return {dim: {k: v for k, v in sorted(kinds.items()) if v} for dim, kinds in out.items() if any(kinds.values())}
