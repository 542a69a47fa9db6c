"""Pipeline parallel: a decoder cut into stages of consecutive layers, run by torch.distributed.pipelining.

The first stage embeds the tokens, the last applies the final norm, the head and the loss; each stage sends its
hidden states (micro-batch x tokens x hidden, tokens / tp under sequence parallel) to the next, and their
gradients come back. Rank r of the pipeline holds stages r, r + pp, ... (one, or virtual_stages when looped).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from advisor.parallel.layout import Layout, PipelineSchedule


class DecoderStage(nn.Module):
    """Layers [lo, hi) of a decoder (advisor/presets/decoders.py); the first stage also holds the embeddings, the
    last the final norm and the output head. Its modules are the decoder's own objects, under the same names, so
    the tensor-parallel plan and the decoder's initialisation apply to them unchanged."""

    def __init__(self, decoder: Any, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tokens_per_shard = 1  # tp under sequence parallel: each rank's hidden states hold tokens / tp (set
        # before a data-parallel wrapper hides the stage's attributes)
        if first:
            self.tok_embeddings = decoder.tok_embeddings
            self.pos_embeddings = decoder.pos_embeddings
        self.blocks = nn.ModuleList(decoder.blocks[lo:hi])
        if last:
            self.norm, self.output = decoder.norm, decoder.output
        object.__setattr__(self, "_decoder", decoder)  # for embed/rope/head, not a submodule of the stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T) in; else hidden states. Last stage: logits (B, T, V) out (under tp a
        DTensor, each rank holding vocab / tp of them); else hidden."""
        dec = self._decoder
        if self.first:
            x = dec.embed(x)
        rope = dec.rope(x.shape[1] * (1 if self.first else self.tokens_per_shard), x.device)
        for block in self.blocks:
            x = block(x, rope)
        return dec.head(x) if self.last else x


@functools.cache
def _lean_stage_class() -> type:
    """LeanStage, made once: this module imports torch.distributed.pipelining only when a schedule is made."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import PipeliningMetadataError, _make_tensor_from_meta, _RecvInfo

    class LeanStage(PipelineStage):
        """torch's PipelineStage, each receive buffer made as its receive is posted and let go once its micro-batch's
        backward ran. torch's own keeps one per micro-batch and stage, for activations and for gradients, from the
        first step to the last: with 64 micro-batches over 12 virtual stages a rank, over 10 GiB on GPT-3 175B's
        published mesh (docs/planner.md)."""

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            if self.is_first:  # the root inputs: no buffers
                super()._setup_forward_recv_info(num_microbatches, has_backward)
                return
            super()._setup_forward_recv_info(0, has_backward)  # checks the metadata
            source = self.stage_index - 1
            for chunk in range(num_microbatches):
                self.args_recv_info[chunk] = tuple(
                    _RecvInfo(f"recv_for_{self.stage_index}_from_{source}", source, None, meta)
                    for meta in self._stage_meta.inputs)

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            if self.is_last:
                return ()
            grads = self._stage_meta.output_grads
            if grads is None:
                raise PipeliningMetadataError(f"Stage {self.stage_index}: no output_grads metadata")
            return tuple(_RecvInfo(f"recv_grad_for_{self.stage_index}_from_{dst[0]}", dst[0], None, grads[idx])
                         for idx, dst in act_send_info.items())

        def _make_buffers(self, infos: tuple) -> None:
            for info in infos:
                if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
            self._make_buffers(self.args_recv_info[fwd_chunk_id])
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
            if self.has_backward and not self.is_last:
                self._make_buffers(self.grad_recv_info[bwd_chunk_id])
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
            outputs = self.fwd_cache.get(bwd_chunk_id, ((),))[0]
            loss = kwargs.get("loss", args[0] if args else None)
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            for info in (*self.args_recv_info.get(bwd_chunk_id, ()), *self.grad_recv_info.get(bwd_chunk_id, ())):
                if not info.is_root_arg:
                    info.buffer = None  # the micro-batch's input and its output's gradient: used
            # The loss the schedule keeps until the step ends, and an output a held send still holds, would keep
            # their spent graph, down to the received input it accumulated a gradient into: cut from it.
            for t in (*(outputs if isinstance(outputs, tuple) else (outputs,)), loss):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None and not t._is_view():
                    t.detach_()

    return LeanStage


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds (looped placement: r, r + pp, ...)."""
    return [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]


def build_stages(decoder: Any, layout: Layout, pp_rank: int) -> list[DecoderStage]:
    """This rank's stages of `decoder` (its layers split by `layout.split`)."""
    bounds = [0]
    for n in layout.split(len(decoder.blocks)):
        bounds.append(bounds[-1] + n)
    last = layout.stages - 1
    stages = [DecoderStage(decoder, bounds[s], bounds[s + 1], first=s == 0, last=s == last)
              for s in stage_ids(layout, pp_rank)]
    for stage in stages:
        stage.tokens_per_shard = layout.tp if layout.tp > 1 and layout.sequence_parallel else 1
    return stages


def make_schedule(stages: list[nn.Module], layout: Layout, *, pp_rank: int, group: Any, device: Any,
                  microbatch: int, seq_len: int, hidden: int, vocab: int, tp_shards: int, loss_fn: Any,
                  hidden_dtype: Any, logits_dtype: Any) -> Any:
    """The schedule that runs `stages` (this rank's, each a DecoderStage or its data-parallel wrapper) with the
    other ranks of the pipeline `group`.

    Stage inputs and outputs are given by shape, so no rank infers them from a run: micro-batch x seq_len token
    ids into the first stage, micro-batch x seq_len / tp_shards x hidden states between stages, logits out of the
    last."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    lean = _lean_stage_class()

    tokens = seq_len // tp_shards
    hidden_state = torch.empty(microbatch, tokens, hidden, dtype=hidden_dtype, device=device)
    ids = torch.zeros(microbatch, seq_len, dtype=torch.int64, device=device)
    logits = torch.empty(microbatch, seq_len, vocab, dtype=logits_dtype, device=device)
    pipe = []
    for module, s in zip(stages, stage_ids(layout, pp_rank)):
        # a later stage's received hidden states need gradients, which backward sends to the stage before
        inp = ids if s == 0 else hidden_state.detach().requires_grad_()
        out = logits if s == layout.stages - 1 else hidden_state
        last = s == layout.stages - 1
        # gradients: of the hidden states a stage received (none for token ids), and of what it sent on
        pipe.append(lean(module, s, layout.stages, device, input_args=(inp,), output_args=(out,),
                         input_grads=(None if s == 0 else hidden_state,),
                         output_grads=(None if last else hidden_state,), group=group))
    n = layout.n_microbatches
    if layout.schedule == PipelineSchedule.interleaved_1f1b:
        return ScheduleInterleaved1F1B(pipe, n, loss_fn=loss_fn)
    cls = ScheduleGPipe if layout.schedule == PipelineSchedule.gpipe else Schedule1F1B
    return cls(pipe[0], n, loss_fn=loss_fn)
