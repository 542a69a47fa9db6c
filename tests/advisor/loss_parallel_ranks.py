"""Gloo ranks run one optimizer step of a decoder's tensor-parallel program (advisor/parallel/program.py), whose
logits stay sharded over the vocabulary and whose loss loss_parallel computes, from the weights of a decoder built
whole from the same seed, and compare it with that decoder's own step on the same batch. Per layout each rank prints
one line: the layout's name, the vocabulary width of its logits (-1 where it does not check them: pipeline and
context parallel), |loss - whole loss| (-1 where its loss is not the batch's: pipeline, context parallel and
accumulation) and the largest difference of the gradients its optimizer step applies from the whole decoder's,
relative to the largest of them. Run by tests/advisor/test_layouts.py (`compare` on 2 or 4 ranks)."""

from __future__ import annotations

import torch

SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32}
BATCH = 4


def _cases(world: int) -> dict[str, tuple[dict, dict, dict]]:
    """name: (workload arguments beyond SHAPE, Layout arguments, build_program/step arguments)."""
    from advisor.config import Checkpointing

    if world == 2:
        return {"tp2": ({}, {"tp": 2}, {}),
                "tp2-no-sp": ({}, {"tp": 2, "sequence_parallel": False}, {}),
                "tp2-tied": ({"tie_embeddings": True}, {"tp": 2}, {}),
                "tp2-ckpt": ({}, {"tp": 2}, {"checkpointing": Checkpointing.full}),
                "tp2-accum2": ({}, {"tp": 2}, {"grad_accum": 2})}
    return {"tp2-pp2": ({}, {"tp": 2, "pp": 2}, {}),
            "tp2-cp2-zero2": ({}, {"tp": 2, "cp": 2, "strategy": "zero2"}, {}),
            "dp2-zero3-tp2": ({}, {"tp": 2, "dp": 2, "strategy": "zero3"}, {})}


def _whole_name(name: str, layout, pp_rank: int) -> str:
    """The whole decoder's name of a program parameter: DDP's prefix dropped; under pp, a stage's (its index in
    the rank's ModuleList, then the decoder's names) with its blocks numbered as the decoder's."""
    from advisor.parallel.pipeline import stage_ids

    name = name.removeprefix("module.")
    if layout.pp == 1:
        return name
    local, rest = name.split(".", 1)
    if not rest.startswith("blocks."):
        return rest
    _, k, tail = rest.split(".", 2)
    first = sum(layout.split(SHAPE["layers"])[:stage_ids(layout, pp_rank)[int(local)]])
    return f"blocks.{first + int(k)}.{tail}"


def _load(program, whole: dict[str, torch.Tensor], pp_rank: int) -> None:
    """Each program parameter's shard of the whole decoder's tensor (every rank holds that tensor: no comm)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in program.model.named_parameters():
            full = whole[_whole_name(name, program.layout, pp_rank)]
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def _case(rank: int, wl_args: dict, lay_args: dict, knobs: dict) -> str:
    from torch.distributed.tensor import DTensor

    from advisor.config import Checkpointing, OptimizerKind, Precision
    from advisor.parallel.accumulate import accumulated_steps
    from advisor.parallel.layout import Layout
    from advisor.parallel.program import build_program
    from advisor.presets._util import token_cross_entropy
    from advisor.workload import load_workload

    workload, layout = load_workload("decoder", {**SHAPE, **wl_args}), Layout(**lay_args)
    grad_accum = knobs.get("grad_accum", 1)
    torch.manual_seed(0)
    decoder = workload.build_model()
    batch = workload.make_batch(BATCH)
    loss = token_cross_entropy(decoder(batch[0]), batch[1])
    loss.backward()
    whole = {n: p.detach() for n, p in decoder.named_parameters()}
    expected = {n: p.grad for n, p in decoder.named_parameters()}

    size = BATCH // grad_accum
    program = build_program(workload, layout, rank=rank, device_type="cpu", device=torch.device("cpu"),
                            precision=Precision.fp32, optimizer=OptimizerKind.sgd, batch_size=size,
                            checkpointing=knobs.get("checkpointing", Checkpointing.none))
    pp_rank = program.coords["pp"]
    _load(program, whole, pp_rank)
    width = -1
    if layout.pp == 1 and layout.cp == 1:
        with torch.no_grad():
            logits = program.model(batch[0])
        width = logits.to_local().shape[-1] if isinstance(logits, DTensor) else logits.shape[-1]

    grads = _gradients_at_step(program)
    for i, (kwargs, _) in enumerate(accumulated_steps(grad_accum)):
        got = program.step(tuple(t[i * size:(i + 1) * size] for t in batch), **kwargs)
    error = abs(float(got) - loss.item()) if layout.pp == 1 and layout.cp == 1 and grad_accum == 1 else -1.0
    largest = max(float(g.abs().max()) for g in grads.values())
    drift = max(float((g - expected[_whole_name(n, layout, pp_rank)]).abs().max()) for n, g in grads.items())
    return f"{width} {error} {drift / largest}"


def _gradients_at_step(program) -> dict[str, torch.Tensor]:
    """Filled, as the program's optimizer clears them after its step, with each parameter's whole gradient: what
    the step applied (reduced over the data-parallel ranks)."""
    from torch.distributed.tensor import DTensor

    opt, out = program.optimizers[0], {}
    names = {id(p): n for n, p in program.model.named_parameters()}
    clear = opt.zero_grad

    def zero_grad(*args, **kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad.detach()
                out[names[id(p)]] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
        return clear(*args, **kwargs)

    opt.zero_grad = zero_grad
    return out


def compare(rank: int, world: int) -> str:
    return "\n".join(f"{name} {_case(rank, *case)}" for name, case in _cases(world).items())

