"""Closed-form memory and collective bytes of one pipeline rank of a decoder under dp x tp x pp, for models too large
to trace quickly: what advisor/parallel/program.py allocates, counted from the shapes (parallel_moments.py adds
them up at the moments the rank's peak can fall on).

Activations follow Korthikanti et al. 2022 (sec. 4.1-4.2: the tensors each layer saves for backward, with tensor
and sequence parallel) applied to our block as analytic.py counts them. Each tp rank keeps its heads' and FFN
slice's tensors (/ tp) and the norm output the column-parallel projections read: whole without sequence parallel
(under autocast, each projection's own copy), its seq_len / tp shard with it (gathered again in backward, tensor.py;
whole under full checkpointing, whose recompute gathers it); the norms' tensors hold seq_len / tp tokens under
sequence parallel, else all. Per token and layer, in
elements (h hidden, f ffn, H heads, t tp, s = 1/t under sequence parallel else 1, n_q, n_s, n_g as analytic.py):
  norms: RMSNorm, which computes in fp32, 2 s h fp32 each (its input, a copy of it under pure bf16, and
      normalised x); LayerNorm s h in the residual dtype; fp32 statistics per token
  attention: n_q h (norm out) + 4 h / t (q, k, v into SDPA, its output) + H / t fp32 (SDPA's logsumexp; not held
      under selective checkpointing, which recomputes SDPA: q, k, v stay as its inputs, the output as wo's)
  FFN: n_s h + 4 f / t (SwiGLU) or n_g h + 2 f / t (GELU)
The last stage keeps the fp32 log-softmax of its vocab / tp slice of the logits (tensor.py keeps them sharded and
loss_parallel computes the loss from the shards), and under pp the logits too (a stage's output waits for its
backward). ZeRO-2/3 are FSDP2 on the dp mesh: every parameter's dim 0 split into dp padded chunks, each block of a
stage that holds two or more a unit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.estimate.parallel_moments import F32, RankDims, RankMemory, StageFigures, StepKnobs, schedule_order
from advisor.estimate.parallel_tuned import Tuning
from advisor.parallel.layout import Layout
from advisor.workload import DecoderArch

if TYPE_CHECKING:
    from advisor.estimate.model import EstimateRequest
    from advisor.estimate.trace import Trace


def analytic_rank(arch: DecoderArch, layout: Layout, pp_rank: int, batch_size: int, *, precision: Precision,
                  optimizer: OptimizerKind, checkpointing: Checkpointing | bool = Checkpointing.none,
                  optimizer_impl: str | None = None, device_type: str = "cuda", grad_accum: int = 1,
                  offload_optimizer: bool = False, offload_params: bool = False,
                  tuning: Tuning | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(peak breakdown in bytes, as strategy.peak_breakdown names its parts; collective payload bytes per optimizer
    step by kind, as comm.py counts them) of every rank of pipeline rank `pp_rank`.

    `batch_size`: samples per data-parallel replica per step (split into layout.n_microbatches under pp);
    `optimizer_impl`: as training.make_optimizer takes it (None: torch's per-parameter loop, as on a CPU);
    `device_type`: the ranks' devices ("cpu": gloo's collectives, "cuda": NCCL's); `grad_accum`: batches whose
    gradients a step accumulates; `offload_optimizer`, `offload_params`: ZeRO-Offload (RankMemory._offload);
    `tuning`: a fine-tune's frozen parts and adapters (parallel_tuned.py), None for full training."""
    mem, comm = rank_memory(arch, layout, pp_rank, batch_size, precision=precision, optimizer=optimizer,
                            checkpointing=checkpointing, optimizer_impl=optimizer_impl, device_type=device_type,
                            knobs=StepKnobs(grad_accum, offload_optimizer, offload_params), tuning=tuning)
    return mem.peak(), comm


def rank_memory(arch: DecoderArch, layout: Layout, pp_rank: int, batch_size: int, *, precision: Precision,
                optimizer: OptimizerKind, checkpointing: Checkpointing | bool, optimizer_impl: str | None,
                device_type: str, knobs: StepKnobs,
                tuning: Tuning | None = None) -> tuple[RankMemory, dict[str, int]]:
    """`analytic_rank`'s RankMemory, before its peak is taken, and its collective bytes."""
    checkpointing = Checkpointing(checkpointing)
    micro = batch_size // layout.n_microbatches if layout.pp > 1 else batch_size
    d = _dims(arch, layout, micro, precision, device_type == "cpu", tuning, checkpointing)
    stages = [_stage(arch, layout, d, s, checkpointing, tuning) for s in _stage_indices(layout, pp_rank)]
    mem = RankMemory(arch, layout, d, stages, pp_rank, optimizer, optimizer_impl, batch_size, checkpointing, knobs)
    comm = _comm(arch, layout, d, stages, pp_rank, checkpointing, knobs.grad_accum)
    return mem, {k: v for k, v in sorted(comm.items()) if v}


def _dims(arch: DecoderArch, layout: Layout, micro: int, precision: Precision, gloo: bool,
          tuning: Tuning | None = None, checkpointing: Checkpointing = Checkpointing.none) -> RankDims:
    pure = precision == Precision.bf16_pure
    autocast = precision.autocast_dtype is not None
    sp = layout.sequence_parallel and layout.tp > 1
    tokens = arch.seq_len // layout.cp  # each context-parallel rank's share of every sequence
    r, w, z = 2 if pure else 4, 0, 0
    if tuning is not None:  # frozen parameters in bf16 under bf16 (hold_frozen): a frozen embedding's output, and
        # the residual stream after it (autocast's products add bf16 to it), are bf16
        w, z = r, 2 if precision in (Precision.bf16, Precision.bf16_pure) else 4
        r = z if tuning.embeddings_frozen() else r
    return RankDims(b=micro, T=tokens, s=tokens // layout.tp if sp else tokens, t=layout.tp,
                    r=r, c=2 if pure or autocast else 4, autocast=autocast, pp=layout.pp > 1,
                    gloo=gloo, ring=layout.cp > 1, w=w, z=z,
                    regather=sp and Checkpointing(checkpointing) != Checkpointing.full)


def _block_shapes(arch: DecoderArch, t: int) -> tuple[tuple[int, int], ...]:
    """One DecoderBlock on one tp rank (tensor.py's plan): wq, wk, wv and the FFN's first matrices keep 1/t of
    their rows, wo and the FFN's last matrix 1/t of their columns; the latter's biases and the norms are whole."""
    h, f = arch.hidden, arch.ffn_hidden // t
    q, kv = h // t, arch.kv_heads * (h // arch.heads) // t
    shapes = [(q, h), (kv, h), (kv, h), (h, q)]
    if arch.bias:
        shapes += [(q, 1), (kv, 1), (kv, 1), (h, 1)]
    if arch.gated_ffn:  # w1, w3, w2: no biases (Llama)
        shapes += [(f, h), (f, h), (h, f)]
    else:  # fc, proj
        shapes += [(f, h), (h, f)] + ([(f, 1), (h, 1)] if arch.bias else [])
    return tuple(shapes) + _norm_shapes(arch) * 2


def _norm_shapes(arch: DecoderArch) -> tuple[tuple[int, int], ...]:
    return ((arch.hidden, 1),) * (1 if arch.norm == "rmsnorm" else 2)


def _root_shapes(arch: DecoderArch, t: int, first: bool, last: bool) -> tuple[tuple[int, int], ...]:
    """Embeddings (first stage) and final norm and output (last), vocabulary rows split by tp (rank 0 keeps the
    larger share where tp does not divide them); a tied output is the embedding's tensor."""
    rows = -(-arch.vocab // t)
    shapes: list[tuple[int, int]] = []
    if first:
        shapes.append((rows, arch.hidden))
        if arch.learned_positions:
            shapes.append((-(-arch.seq_len // t), arch.hidden))
    if last:
        shapes += _norm_shapes(arch)
        if not (first and arch.tied_embeddings):
            shapes.append((rows, arch.hidden))
    return tuple(shapes)


def _embedding_rows(arch: DecoderArch, first: bool) -> tuple[int, ...]:
    return ((arch.vocab,) + ((arch.seq_len,) if arch.learned_positions else ())) if first else ()


def _stage(arch: DecoderArch, layout: Layout, d: RankDims, index: int, checkpointing: Checkpointing,
           tuning: Tuning | None = None) -> StageFigures:
    """Stage `index`'s figures on one tp rank (pipeline.py's DecoderStage, tensor.py's plan); a fine-tune's
    (`tuning`) by parallel_tuned.py."""
    if tuning is not None:
        from advisor.estimate.parallel_tuned import tuned_stage

        return tuned_stage(arch, layout, d, index, checkpointing, tuning)
    layers = layout.split(arch.layers)[index]
    first, last = index == 0, index == layout.stages - 1
    block, root = _block_shapes(arch, d.t), _root_shapes(arch, d.t, first, last)
    out_rows, norms = -(-arch.vocab // d.t), sum(n for n, _ in _norm_shapes(arch))
    block_linear = sum(a * b for a, b in block) - 2 * norms
    # training.repeated_blocks: blocks are units (FSDP, checkpointing) only where a stage holds two or more
    grouped = layers >= 2
    checkpointed = checkpointing == Checkpointing.full and grouped
    full = _layer_saved(arch, d)
    if checkpointing == Checkpointing.selective and grouped:  # SDPA's logsumexp is recomputed, not held
        full -= d.b * d.T * arch.heads // d.t * F32
    per_layer = d.b * d.s * arch.hidden * d.r if checkpointed else full  # a checkpoint keeps the block's input
    recompute = full if checkpointed else 0  # a checkpointed block runs its forward again before its backward
    output, loss, head_bwd = _loss_extra(arch, d) if last else (0, 0, 0)
    embeddings = _embedding_rows(arch, first)
    rope = 0 if arch.learned_positions else 2 * d.T * (arch.hidden // arch.heads) * F32
    return StageFigures(
        first=first, last=last, layers=layers,
        units=((block,) * layers + (root,)) if grouped else (block * layers + root,),
        linear=layers * block_linear + out_rows * arch.hidden * last, block_linear=block_linear,
        block_bytes=sum(a * b for a, b in block) * d.r * (layers > 0),
        largest=max([a * b for a, b in block if b > 1] * (layers > 0) + [out_rows * arch.hidden * last]) * d.r,
        saved=layers * per_layer + _ends_saved(arch, d, first, last, checkpointed),
        per_layer=per_layer, first_block=per_layer * (layers > 0) + rope,
        output_extra=output, loss_extra=loss, head_bwd=head_bwd,
        block_bwd=(recompute + _block_backward(arch, d, True), recompute + _block_backward(arch, d, False)),
        log_softmax=logits(arch, d) * F32 * last,
        head=_ends_saved(arch, d, False, True) - _ends_saved(arch, d, False, False) if last else 0,
        head_grad=out_rows * arch.hidden * d.r * last,
        embed_grad=sum(embeddings) * arch.hidden * d.r,
        grad_extra=sum(embeddings) * arch.hidden * d.r - sum(a * b for a, b in root[: len(embeddings)]) * d.r)


def _layer_saved(arch: DecoderArch, d: RankDims) -> int:
    """Bytes one DecoderBlock saves for backward per micro-batch (module docstring)."""
    h, f, t = arch.hidden, arch.ffn_hidden // d.t, d.t
    tokens, local = d.b * d.T, d.b * d.s
    norm = local * _norm_saved(arch, d)
    read = tokens * h * (d.c if d.autocast else d.r)  # a norm's output as a projection reads it
    # what the attention's and the FFN's projections read: each its own autocast copy of the norm's output, or
    # (regathered) one shard of it in the residual dtype
    reads = (1, 1) if d.regather else ((3, 2 if arch.gated_ffn else 1) if d.autocast else (1, 1))
    if d.regather:
        read = local * h * d.r
    # q, k, v into attention and its output; the ring keeps k and v with their KV heads, SDPA expanded to H
    qkvo = 4 * h // t if not d.ring else 2 * h // t + 2 * arch.kv_heads * (h // arch.heads) // t
    attn = reads[0] * read + tokens * (qkvo * d.c + arch.heads // t * F32)
    ffn = reads[1] * read + tokens * (4 if arch.gated_ffn else 2) * f * d.c
    return 2 * norm + attn + ffn


def _norm_saved(arch: DecoderArch, d: RankDims) -> int:
    """Bytes a norm saves per token: RMSNorm, which computes in fp32, its input in fp32 (a copy under pure bf16),
    normalised x and 1/rms; LayerNorm its input, mean and 1/std."""
    if arch.norm == "rmsnorm":
        return 2 * arch.hidden * F32 + F32
    return arch.hidden * d.r + 2 * F32


def _norm_keeps_input(arch: DecoderArch, d: RankDims) -> bool:
    """Whether a norm saves its input tensor itself (else an fp32 copy of it)."""
    return arch.norm == "layernorm" or d.r == F32


def _ends_saved(arch: DecoderArch, d: RankDims, first: bool, last: bool, checkpointed: bool = False) -> int:
    """Bytes per micro-batch a stage saves beyond its blocks: RoPE's tables (each stage's forward makes them), the
    head (final norm, the output layer's input, the fp32 log-softmax of this rank's logits, and under pp the logits
    waiting for backward), a stage's output waiting for its backward (pp), and the input a later stage received,
    held for its backward, where its first block keeps only an fp32 copy of it (where the block saves the input
    itself, or its checkpoint does (`checkpointed`), the block's bytes count it)."""
    h, tokens, local = arch.hidden, d.b * d.T, d.b * d.s
    out = 0 if arch.learned_positions else 2 * d.T * (h // arch.heads) * F32
    if first and arch.learned_positions:
        out += d.T * 8  # the position ids the position embedding saves
    if last:
        out += local * _norm_saved(arch, d) + tokens * h * (d.c if d.autocast else d.r)
        out += logits(arch, d) * (F32 + (d.c if d.pp else 0))
    elif d.pp:
        out += local * h * d.r
    if d.pp and not first and not (checkpointed or _norm_keeps_input(arch, d)):
        out += local * h * d.r  # the input it received, beside the fp32 copy its first norm keeps
    return out


def logits(arch: DecoderArch, d: RankDims) -> int:
    """Elements of one micro-batch's logits on a rank: its vocab / tp of them (tp rank 0's larger share where tp
    does not divide the vocabulary), the loss's log-softmax and their gradients alike."""
    return d.b * d.T * -(-arch.vocab // d.t)


def _loss_extra(arch: DecoderArch, d: RankDims) -> tuple[int, int, int]:
    """Bytes beyond what the last stage saves (may be negative): as the output layer's forward ends (its logits; the
    log-softmax, counted as saved, not made yet), while the loss runs (the logits, their fp32 copy; loss_parallel's
    log-softmax also holds the shifted logits beside their exponentials), and at the start of backward (the fp32
    gradients of the log-softmax's output and input; loss_parallel's fused backward holds a one-hot tensor, the
    log-softmax's exponentials and their sum)."""
    n = logits(arch, d)
    counted = n * (F32 + (d.c if d.pp else 0))  # in _ends_saved: log-softmax, logits under pp
    loss = n * (0 if d.pp else d.c) + n * (F32 if d.c != F32 else 0) + n * F32 * (d.t > 1)
    return n * d.c - counted, loss, (3 if d.t > 1 else 2) * n * F32


def _block_backward(arch: DecoderArch, d: RankDims, first: bool, weights: bool = True) -> int:
    """Bytes beyond the saved ones at the heights of a block's FFN backward: its last matrix's weight and input
    gradients; then, that matrix's input freed, (SwiGLU) both gradients of the gating product; then, the FFN's
    activations freed, the gradients of its input (each Linear's, their fp32 casts under autocast, their sum) beside
    the FFN's weight gradients. The stage's first backward keeps its weight gradients; a later one adds each into
    the kept one and frees it. `weights`: the FFN's weights train (a frozen one makes no gradient)."""
    h, f = arch.hidden, arch.ffn_hidden // d.t
    inner, weight = d.b * d.T * f * d.c, h * f * d.pw * weights
    matrices = 3 if arch.gated_ffn else 2
    product = (2 if arch.gated_ffn else 1) * inner
    reads = (2 if arch.gated_ffn else 1) if d.autocast else 1
    saved = (4 if arch.gated_ffn else 2) * inner + reads * d.b * d.T * h * (d.c if d.autocast else d.r)
    input_grads = (5 if d.autocast else 3) * d.b * d.T * h * d.r - saved
    if first:
        return max(weight + inner, weight + product, matrices * weight + input_grads)
    return max(weight + inner, product, weight + input_grads)


def _comm(arch: DecoderArch, layout: Layout, d: RankDims, stages: list[StageFigures], pp_rank: int,
          checkpointing: Checkpointing, grad_accum: int = 1) -> dict[str, int]:
    """Payload bytes per optimizer step by kind (comm.py): parallel_comm.comm_by_dim's, summed over the mesh's
    dimensions."""
    from collections import Counter

    out: Counter[str] = Counter()
    for kinds in layout_comm(arch, layout, d, stages, pp_rank, checkpointing, grad_accum).values():
        out.update(kinds)
    return dict(out)


def layout_comm(arch: DecoderArch, layout: Layout, d: RankDims, stages: list[StageFigures], pp_rank: int,
                checkpointing: Checkpointing, grad_accum: int = 1) -> dict[str, dict[str, int]]:
    """parallel_comm.comm_by_dim's payload bytes by mesh dimension; where the stages hold frozen parameters (a
    fine-tune), its data-parallel ones as parallel_tuned.tuned_data_comm counts them."""
    from advisor.estimate.parallel_comm import comm_by_dim

    out = comm_by_dim(arch, layout, d, stages, pp_rank, checkpointing, grad_accum)
    if any(st.frozen_units for st in stages):
        from advisor.estimate.parallel_tuned import tuned_data_comm

        out = {k: v for k, v in out.items() if k not in ("dp", "replicate")}
        out.update(tuned_data_comm(layout, d, stages, pp_rank, grad_accum))
    return out


def regather_bytes(arch: DecoderArch, d: RankDims, layers: int) -> int:
    """Bytes one micro-batch's backward gathers again over `layers` blocks (tensor.py's regather: both regions'
    inputs, residual dtype); 0 where the regions keep their gathered inputs."""
    return layers * d.b * d.T * arch.hidden * 2 * d.r if d.regather else 0


def _tensor_comm(arch: DecoderArch, d: RankDims, st: StageFigures, checkpointing: Checkpointing) -> dict[str, int]:
    """One micro-batch's tensor-parallel collectives on one stage, forward and backward. Sequence parallel: each
    column-parallel region gathers its input (a norm's output, residual dtype), and again in backward (tensor.py's
    regather), where it reduce-scatters the gradient; each row-parallel output (compute dtype) is reduce-scattered
    and its gradient gathered. Without it, all-reduces of the row-parallel outputs and of the regions' input
    gradients. A checkpointed block's backward
    runs its forward again as far as its last saved tensor (the FFN's last matrix's input): both gathers, and the
    attention's reduce-scatter (all-reduce without sequence parallel)."""
    bth = d.b * d.T * arch.hidden
    again = checkpointing == Checkpointing.full and st.layers >= 2  # selective recomputes SDPA alone: no collective
    sp = d.s != d.T
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if sp:  # the checkpoint's recompute gathers both regions' inputs a second time, as backward's regather does
        out["all_gather"] += st.layers * bth * (2 * d.r * (2 if again else 1) + 2 * d.c)
        out["all_gather"] += regather_bytes(arch, d, st.layers)
        out["reduce_scatter"] += st.layers * bth * (d.c * (3 if again else 2) + 2 * d.r)
    else:
        out["all_reduce"] += st.layers * bth * (d.c * (3 if again else 2) + 2 * d.r)
    if st.first:  # the embeddings' vocabulary-parallel lookups are all-reduced; sp then keeps this rank's tokens
        out["all_reduce"] += bth * d.r + (d.T * arch.hidden * d.r if arch.learned_positions else 0)
        out["all_gather"] += bth * d.r if sp else 0
    if st.last:  # the output layer's input gathered (sp); loss_parallel all-reduces each token's fp32 maximum, sum
        # of exponentials and target logit (its backward communicates nothing)
        out["all_gather"] += bth * d.r if sp else 0
        out["reduce_scatter" if sp else "all_reduce"] += bth * d.r
        out["all_reduce"] += 3 * d.b * d.T * F32
    return out


def gathering_batches(layout: Layout, grad_accum: int) -> int:
    """How many of a step's `grad_accum` batches gather the FSDP units: one under ZeRO-2 without pp, whose units
    stay gathered from the first batch's forward to the last one's backward (advisor/parallel/accumulate.py);
    each, otherwise."""
    return 1 if layout.strategy.keeps_gathered and layout.pp == 1 else grad_accum


@functools.lru_cache(maxsize=4096)  # the planner sizes the same layouts' stages many times
def _gathers(layout: Layout, pp_rank: int, count: int) -> tuple[int, ...]:
    """All-gathers per FSDP unit of each local stage in a step: a forward or backward that finds the unit sharded
    gathers it; ZeRO-3 reshards after each forward, and after each backward without pp (pipelining keeps the
    parameters until its last backward); ZeRO-2 keeps them until the step's backward ends."""
    zero3 = layout.strategy == Strategy.zero3
    gathered, counts = [False] * count, [0] * count
    for kind, i in schedule_order(layout, pp_rank):
        counts[i] += not gathered[i]
        gathered[i] = (kind == "B" and layout.pp > 1) or (kind == "F" and not zero3)
    return tuple(counts)


def analytic_rank_trace(arch: DecoderArch, layout: Layout, pp_rank: int, request: EstimateRequest, *,
                        device_type: str, optimizer_impl: str | None = None,
                        grad_accum: int = 1) -> tuple[Trace, dict[str, int]]:
    """`analytic_rank` as a one-moment synthetic Trace (the peak, its parts in trace.py's categories, so that
    strategy.peak_breakdown reads them back and overhead.cuda_overhead treats it as formulas; its parameter,
    gradient and optimizer-state bytes the rank's at the step, as a traced run's, offload aside) and the
    collective bytes: what estimate_layout takes from a rank's trace. The request's offload applies."""
    import numpy as np

    from advisor.estimate.trace import (
        ACTIVATIONS,
        CATEGORY_NAMES,
        GRADS,
        OPT_STATE,
        PARAMS,
        TEMPORARIES,
        Trace,  # noqa: F811 - the runtime import of the annotation's class
    )

    knobs = StepKnobs(grad_accum, request.offload_optimizer, request.offload_params)
    mem, comm = rank_memory(arch, layout, pp_rank, request.batch_size, precision=request.precision,
                            optimizer=request.optimizer, checkpointing=request.checkpointing,
                            optimizer_impl=optimizer_impl, device_type=device_type, knobs=knobs)
    parts = mem.peak()
    row = np.zeros((1, len(CATEGORY_NAMES)), dtype=np.int64)
    for name, cat in (("parameters", PARAMS), ("gradients", GRADS), ("optimizer_state", OPT_STATE),
                      ("activations", ACTIVATIONS), ("temporaries", TEMPORARIES)):
        row[0, cat] = parts[name]
    total = int(row.sum())
    layers = [layout.split(arch.layers)[s] for s in _stage_indices(layout, pp_rank)]
    block = sum(a * b for a, b in _block_shapes(arch, layout.tp))
    trace = Trace(curve=row, sizes=np.asarray([total], dtype=np.int64), ids=np.zeros(1, dtype=np.int64),
                  param_bytes=mem.at_rest[0], grad_bytes=mem.at_rest[1], opt_state_bytes=mem.at_rest[2],
                  largest_block_bytes=block * (4 if
                  request.precision != Precision.bf16_pure else 2), flops_per_step=0,
                  num_params=sum(layers) * block, seconds=0.0, synthetic=True)
    return trace, comm


def _stage_indices(layout: Layout, pp_rank: int) -> list[int]:
    return [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]
