"""The parallel layout of a training run: how many ranks split each dimension, and the checks it must pass.

Ranks form a mesh pp x dp_replicate x dp_shard x cp x tp (tp innermost: the ranks that exchange activations every
layer sit next to each other, within a node, then the context-parallel ranks that pass keys and values around a
ring), as Megatron-LM and torchtitan order it. dp = dp_replicate x dp_shard: under HSDP the parameters are sharded
within a group of dp_shard ranks and replicated across dp_replicate groups.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from advisor.config import Strategy
from advisor.errors import SpecError, invalid_input

if TYPE_CHECKING:
    from advisor.workload import DecoderArch


class PipelineSchedule(str, Enum):
    gpipe = "gpipe"  # all forwards, then all backwards: every micro-batch's activations held at once
    one_f_one_b = "1f1b"  # steady state alternates: stage s holds pp - s micro-batches at most
    interleaved_1f1b = "interleaved-1f1b"  # 1F1B over virtual stages: smaller bubble, more sends

    @property
    def looped(self) -> bool:
        return self == PipelineSchedule.interleaved_1f1b


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class Layout(BaseModel):
    """How the ranks of one run split the work. world = dp x cp x tp x pp; `strategy` is the data-parallel part."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(default=1, ge=1, description="Data-parallel replicas (or shards, under ZeRO).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks: each layer's heads and FFN split across them.")
    pp: int = Field(default=1, ge=1, description="Pipeline ranks: the layers cut into consecutive stages.")
    cp: int = Field(default=1, ge=1, description="Context-parallel ranks: each holds seq_len/cp tokens of every "
                    "sample, attention's keys and values passed around them in a ring.")
    dp_replicate: int = Field(default=1, ge=1, description="HSDP: groups the dp ranks form, each holding the whole "
                              "model sharded over dp/dp_replicate ranks (a node), gradients all-reduced across "
                              "groups; 1: one group (plain ZeRO).")
    strategy: Strategy = Field(default=Strategy.single, description="How the dp ranks hold the model.")
    schedule: PipelineSchedule = Field(default=PipelineSchedule.one_f_one_b, description="Pipeline schedule.")
    microbatches: int | None = Field(default=None, ge=1, description="Micro-batches per step through the pipeline; "
                                     "None: pp x virtual_stages (the fewest that fill it).")
    virtual_stages: int = Field(default=1, ge=1, description="Stages per pipeline rank (interleaved 1F1B: >= 2).")
    stage_layers: tuple[int, ...] | None = Field(default=None, description="Layers of each stage, first to last; "
                                                 "None: as even as the layers allow, the remainder to the first.")
    sequence_parallel: bool = Field(default=True, description="Norms and residuals sharded along the sequence "
                                    "between tensor-parallel regions (Korthikanti et al. 2022).")

    @model_validator(mode="after")
    def _structural(self) -> "Layout":
        problems = structural_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """Ranks each data-parallel group shards the model over (dp under plain ZeRO)."""
        return self.dp // self.dp_replicate

    @property
    def grad_ranks(self) -> int:
        """Ranks that hold the same parameters and average their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def fsdp_shards(self) -> int:
        """Ranks ZeRO shards each parameter over: dp_shard x cp (replicated across dp_replicate groups)."""
        return self.dp_shard * self.cp

    @property
    def stages(self) -> int:
        """Pipeline stages in all (pp x virtual_stages)."""
        return self.pp * self.virtual_stages

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.stages

    @property
    def parallel(self) -> bool:
        """Whether anything beyond data parallel applies (the rank program of advisor/parallel runs it)."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.dp_replicate > 1

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (MESH_DIMS, tp innermost), and along dp (its data-parallel
        replica: dp_replicate x dp_shard)."""
        out = {}
        for name, size in zip(reversed(MESH_DIMS), (self.tp, self.cp, self.dp_shard, self.dp_replicate, self.pp)):
            out[name], rank = rank % size, rank // size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return {name: out[name] for name in (*MESH_DIMS, "dp")}

    def split(self, layers: int) -> tuple[int, ...]:
        """Layers per stage: `stage_layers` where given, else even with the remainder to the first stages."""
        if self.stage_layers is not None:
            return self.stage_layers
        base, extra = divmod(layers, self.stages)
        return tuple(base + (1 if s < extra else 0) for s in range(self.stages))

    def label(self) -> str:
        parts = [f"dp{self.dp}" + (f" {self.strategy.value}" if self.dp > 1 else "")
                 + (f" ({self.dp_replicate} x {self.dp_shard} hsdp)" if self.dp_replicate > 1 else ""),
                 f"tp{self.tp}", f"pp{self.pp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        if self.pp > 1:
            parts.append(f"{self.schedule.value} x{self.n_microbatches} mb"
                         + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts)


def structural_problems(lay: Layout) -> list[str]:
    """What is wrong with the layout on its own (no model, no devices): one line each."""
    out = []
    reducing = lay.grad_ranks
    if reducing == 1 and lay.strategy != Strategy.single:
        out.append(f"strategy {lay.strategy.value} shards over data-parallel ranks, but dp is 1; "
                   "use strategy single, or more processes than tp x pp")
    if reducing > 1 and lay.strategy == Strategy.single:
        out.append(f"dp {lay.dp} x cp {lay.cp} ranks average their gradients, which needs a data-parallel "
                   "strategy: ddp, zero1, zero2 or zero3" if lay.cp > 1 else
                   f"dp {lay.dp} needs a data-parallel strategy: ddp, zero1, zero2 or zero3")
    if reducing > 1 and lay.tp > 1 and lay.strategy in (Strategy.ddp, Strategy.zero1):
        out.append(f"strategy {lay.strategy.value} cannot hold tensor-parallel (DTensor) parameters; "
                   "with tp > 1 use zero2 or zero3 (FSDP2) for the data-parallel part")
    if lay.dp % lay.dp_replicate:
        out.append(f"dp_replicate {lay.dp_replicate} does not divide dp {lay.dp}; HSDP needs dp = dp_replicate x "
                   "dp_shard")
    elif lay.dp_replicate > 1 and lay.strategy not in (Strategy.zero2, Strategy.zero3):
        out.append(f"dp_replicate {lay.dp_replicate} (HSDP) shards within each group: use strategy zero2 or zero3, "
                   f"not {lay.strategy.value}")
    if lay.schedule.looped and lay.pp > 1 and lay.virtual_stages < 2:
        out.append("schedule interleaved-1f1b needs virtual_stages >= 2 (stages per pipeline rank)")
    if not lay.schedule.looped and lay.virtual_stages > 1:
        out.append(f"virtual_stages {lay.virtual_stages} needs schedule interleaved-1f1b")
    if lay.pp > 1 and lay.n_microbatches < lay.pp:
        out.append(f"microbatches {lay.n_microbatches} cannot fill a pipeline of {lay.pp} ranks; give >= {lay.pp}")
    if lay.schedule.looped and lay.pp > 1 and lay.n_microbatches % lay.pp:
        out.append(f"interleaved-1f1b needs microbatches a multiple of pp ({lay.pp}), not {lay.n_microbatches}")
    if lay.stage_layers is not None and len(lay.stage_layers) != lay.stages:
        out.append(f"stage_layers gives {len(lay.stage_layers)} stages; the layout has {lay.stages} "
                   f"(pp {lay.pp} x virtual_stages {lay.virtual_stages})")
    if lay.stage_layers is not None and min(lay.stage_layers, default=1) < 1:
        out.append("every stage needs at least one layer")
    return out


def layout_problems(lay: Layout, *, world: int | None = None, decoder: "DecoderArch | None" = None,
                    model_name: str = "the model", batch_size: int | None = None) -> list[str]:
    """What stops `lay` from running `decoder` (or a model that is not a decoder: None) on `world` devices with
    micro-batches of `batch_size` samples: one line each, what was wrong and what is allowed."""
    out = []
    if world is not None and lay.world != world:
        out.append(f"the mesh dp {lay.dp} x cp {lay.cp} x tp {lay.tp} x pp {lay.pp} = {lay.world} ranks, but there "
                   f"are {world} devices; the product must equal the device count")
    if decoder is None:
        if lay.pp > 1:
            out.append(f"pp needs a decoder (layers to cut into stages); {model_name} is not one: "
                       "use the decoder presets or -w decoder")
        if lay.cp > 1:
            out.append(f"cp splits the sequence of causal self-attention; {model_name} has none that cp can split: "
                       "use the decoder presets or -w decoder")
        return out
    if lay.cp > 1 and decoder.seq_len % (2 * lay.cp):
        out.append(f"cp {lay.cp} splits seq_len {decoder.seq_len} into 2 x cp chunks (each rank one early and one "
                   f"late, for causal balance); choose seq_len a multiple of {2 * lay.cp}")
    if lay.tp > 1:
        for what, n in (("heads", decoder.heads), ("kv_heads", decoder.kv_heads), ("ffn", decoder.ffn_hidden)):
            if n % lay.tp:
                allowed = [d for d in range(1, n + 1) if n % d == 0 and (decoder.heads % d == 0)
                           and decoder.kv_heads % d == 0 and decoder.ffn_hidden % d == 0]
                out.append(f"tp {lay.tp} does not divide {what} {n} of {model_name}; tp may be "
                           f"{', '.join(map(str, allowed))}")
                break
        tokens = decoder.seq_len // lay.cp  # each context-parallel rank's tokens
        if lay.sequence_parallel and tokens % lay.tp:
            out.append(f"sequence parallel splits {tokens} tokens per rank (seq_len {decoder.seq_len} / cp {lay.cp}) "
                       f"over tp {lay.tp}, which does not divide them; choose seq_len a multiple of cp x tp or "
                       "sequence_parallel off")
    if lay.pp > 1:
        if lay.stages > decoder.layers:
            out.append(f"pp {lay.pp} x virtual_stages {lay.virtual_stages} = {lay.stages} stages, but "
                       f"{model_name} has {decoder.layers} layers; at most {decoder.layers} stages")
        elif lay.stage_layers is not None and sum(lay.stage_layers) != decoder.layers:
            out.append(f"stage_layers sums to {sum(lay.stage_layers)}; {model_name} has {decoder.layers} layers")
        if decoder.tied_embeddings:
            out.append(f"{model_name} ties its output to its embedding, which pp puts on different ranks; "
                       "use tie_embeddings=false")
        if batch_size is not None and lay.n_microbatches > 0 and batch_size % lay.n_microbatches:
            out.append(f"batch {batch_size} does not split into {lay.n_microbatches} micro-batches; "
                       f"use a multiple of {lay.n_microbatches}")
    return out


def layout_over(devices: int, *, tp: int = 1, pp: int = 1, cp: int = 1, where: str = "the hardware",
                **fields: object) -> Layout:
    """The layout of tp x pp x cp ranks and data parallel over the rest of `devices` (`fields`: Layout's other
    fields), or a one-line SpecError saying what is wrong: what the CLI (exit 2) and the API (422) build."""
    if tp < 1 or pp < 1 or cp < 1:
        raise SpecError(f"tp, pp and cp must be positive integers, got tp {tp}, pp {pp}, cp {cp}")
    if devices % (tp * pp * cp):
        raise SpecError(f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the {devices} devices of "
                        f"{where}; the mesh dp x cp x tp x pp must equal the devices")
    try:
        return Layout(dp=devices // (tp * pp * cp), tp=tp, pp=pp, cp=cp, **fields)
    except ValidationError as exc:
        raise invalid_input(exc) from exc
