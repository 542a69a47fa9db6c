"""The Python export of a configuration: a training script, generated knob by knob from the
TrainingConfig, that a user runs as is (on the advisor's workload) or pastes from."""

from __future__ import annotations

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import SpecError
from advisor.trial import GLOO_EXIT_PAUSE_S, CompileMode, Pinning, TrainingConfig

_OPTIMIZERS = {
    OptimizerKind.sgd: ("torch.optim.SGD", ""), OptimizerKind.sgd_momentum: ("torch.optim.SGD", ", momentum=0.9"),
    OptimizerKind.adam: ("torch.optim.Adam", ""), OptimizerKind.adamw: ("torch.optim.AdamW", ""),
    OptimizerKind.adagrad: ("torch.optim.Adagrad", ""),
}


def _cpus(cpu_list: str) -> str:
    """'0-3,8' -> a Python set expression of those CPU numbers."""
    cpus: list[int] = []
    for part in cpu_list.split(","):
        low, _, high = part.strip().partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return "{" + ", ".join(map(str, cpus)) + "}"


def _header(c: TrainingConfig, spec: str, args: dict) -> list[str]:
    changes = ", ".join(f"{k}={v}" for k, v in c.changes().items()) or "PyTorch defaults"
    run = f"torchrun --nproc-per-node {c.nproc} train.py" if c.nproc > 1 else "python train.py"
    return [
        f'"""Training setup chosen by advisor for {spec} ({c.device}): {changes}.',
        "",
        "As it stands it trains the advisor's workload, so you can check it runs: STEPS=20 " + run,
        "Paste the parts you need into your own script; replace `workload` with your model, data and loss.",
        '"""',
        "import os",
        "from contextlib import nullcontext",
        "",
        "import torch",
        "from torch.utils.data import DataLoader",
        "",
        "from advisor.workload import load_workload",
        "",
        'STEPS = int(os.environ.get("STEPS", "1000"))  # optimizer steps',
        f"BATCH_SIZE = {c.batch_size}  # samples per process per micro-batch",
        f"GRAD_ACCUM = {c.grad_accum}  # micro-batches per optimizer step",
        f"workload = load_workload({spec!r}, {args!r})  # your model (build_model), data and loss_fn",
        "",
    ]


def _process(c: TrainingConfig) -> list[str]:
    out = []
    if c.threads:
        out.append(f"torch.set_num_threads({c.threads})  # intra-op threads per process")
    if c.pinning == Pinning.cpus and c.cpu_list:
        out.append(f"os.sched_setaffinity(0, {_cpus(c.cpu_list)})  # pin to CPUs {c.cpu_list}")
    elif c.pinning == Pinning.node:
        out.append("# pinning to the device's NUMA node: see the torchrun export (numactl / --numa-binding node)")
    if c.nproc > 1:
        backend = "nccl" if c.device == "cuda" else "gloo"
        out += ["import torch.distributed as dist", "", f'dist.init_process_group("{backend}")',
                'local_rank = int(os.environ["LOCAL_RANK"])']
        if c.device == "cuda":
            out += ["torch.cuda.set_device(local_rank)", 'device = torch.device("cuda", local_rank)']
        else:
            out.append('device = torch.device("cpu")')
    else:
        out.append(f'device = torch.device("{c.device}")')
    if c.precision == Precision.tf32:
        out += ["torch.backends.cuda.matmul.allow_tf32 = True", "torch.backends.cudnn.allow_tf32 = True"]
    return out + [""]


def _model(c: TrainingConfig, finetuned: bool = False) -> list[str]:
    out = ["model = workload.build().to(device)  # build_model(); lazy modules made by one forward pass"]
    if finetuned and c.precision in (Precision.bf16, Precision.bf16_pure):
        out = ["from advisor.finetune import hold_frozen", "",
               f'model = hold_frozen(workload.build(), "{c.precision.value}").to(device)  # frozen base in bf16']
    if c.channels_last:
        out.append("model = model.to(memory_format=torch.channels_last)  # NHWC for convolutions")
    if c.precision == Precision.bf16_pure:
        out.append("model = model.to(torch.bfloat16)  # pure bf16: weights, gradients and optimizer state")
    if c.checkpointing == Checkpointing.full or c.strategy in (Strategy.zero2, Strategy.zero3):
        out.append("from advisor.training import repeated_blocks  # or your model's list of blocks (layers, stages)")
    if c.checkpointing == Checkpointing.selective:
        out += ["from advisor.training import apply_activation_checkpointing", "",
                "# each block's scaled_dot_product_attention calls run in a checkpoint: recomputed in backward",
                'apply_activation_checkpointing(model, "selective")']
    elif c.checkpointing:
        out += ["from functools import partial", "from torch.utils.checkpoint import checkpoint", "",
                "for block in repeated_blocks(model):  # recompute each block's activations in backward",
                "    block.forward = partial(checkpoint, block.forward, use_reentrant=False)"]
    if c.strategy in (Strategy.ddp, Strategy.zero1):
        ids = "device_ids=[local_rank]" if c.device == "cuda" else ""
        out += ["from torch.nn.parallel import DistributedDataParallel as DDP", "",
                f"model = DDP(model{', ' if ids else ''}{ids})"]
    elif c.strategy in (Strategy.zero2, Strategy.zero3):
        reshard = c.strategy == Strategy.zero3  # zero3 frees gathered parameters after forward
        out += ["from torch.distributed.fsdp import fully_shard", "",
                "for block in repeated_blocks(model):",
                f"    fully_shard(block, reshard_after_forward={reshard})",
                f"model = fully_shard(model, reshard_after_forward={reshard})"]
    return out + [""]


def _optimizer(c: TrainingConfig) -> list[str]:
    if c.optimizer == OptimizerKind.rowwise_adagrad:
        return ["from advisor.training import RowWiseAdagrad", "",
                "optimizer = RowWiseAdagrad(model.parameters(), lr=1e-2)", ""]
    cls, extra = _OPTIMIZERS[c.optimizer]
    impls = {"for-loop": ", foreach=False", "foreach": ", foreach=True", "fused": ", fused=True"}
    impl = impls.get(c.optimizer_impl or "", "")
    if c.optimizer == OptimizerKind.adagrad and impl == ", fused=True":
        impl = ""  # Adagrad has no fused kernel in torch
    kw = f"lr=1e-3{extra}{impl}"
    if c.fused_backward:
        return ["# the optimizer step runs inside backward, one parameter at a time, freeing each gradient",
                "optimizers = {p: " + f"{cls}([p], {kw})" + " for p in model.parameters() if p.requires_grad}",
                "", "def step_and_free(param):", "    optimizers[param].step()", "    param.grad = None", "",
                "for p in optimizers:", "    p.register_post_accumulate_grad_hook(step_and_free)",
                "optimizer = None", ""]
    if c.strategy == Strategy.zero1:
        return ["from torch.distributed.optim import ZeroRedundancyOptimizer", "",
                f"optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class={cls}, {kw})", ""]
    return [f"optimizer = {cls}(model.parameters(), {kw})", ""]


def _compile_and_scaler(c: TrainingConfig) -> list[str]:
    out = []
    if c.compile_mode == CompileMode.default:
        out.append("model = torch.compile(model)")
    elif c.compile_mode != CompileMode.none:
        out.append(f'model = torch.compile(model, mode="{c.compile_mode.value}")')
    if c.precision == Precision.fp16:
        out.append(f'scaler = torch.amp.GradScaler("{c.device}")  # fp16 gradients need loss scaling')
    return out + ([""] if out else [])


def _data(c: TrainingConfig, has_dataset: bool) -> list[str]:
    kw = [f"num_workers={c.num_workers}", f"pin_memory={c.pin_memory}"]
    if c.num_workers:
        kw.append(f"persistent_workers={c.persistent_workers}")
        if c.prefetch_factor is not None:
            kw.append(f"prefetch_factor={c.prefetch_factor}")
    knobs = ", ".join(kw)
    if not has_dataset:
        return ["class Batches(torch.utils.data.IterableDataset):  # whole batches from make_batch",
                "    def __iter__(self):", "        while True:",
                "            yield workload.make_batch(BATCH_SIZE)", "", "sampler = None",
                f"loader = DataLoader(Batches(), batch_size=None, {knobs})", ""]
    out = ["dataset = workload.dataset()"]
    if c.nproc > 1:
        out += ["from torch.utils.data.distributed import DistributedSampler", "",
                "sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)", "order = dict(sampler=sampler)"]
    else:
        out += ["sampler = None", "order = dict(shuffle=True)"]
    out.append(f"loader = DataLoader(dataset, batch_size=BATCH_SIZE, drop_last=True, collate_fn=workload.collate_fn, "
               f"**order, {knobs})")
    return out + [""]


def _to_device(c: TrainingConfig) -> list[str]:
    out = ["def to_device(batch):", "    def move(x):", "        if not isinstance(x, torch.Tensor):",
           "            return x", f"        x = x.to(device, non_blocking={c.pin_memory})"]
    if c.channels_last:
        out += ["        if x.dim() == 4 and x.is_floating_point():",
                "            x = x.contiguous(memory_format=torch.channels_last)"]
    if c.precision == Precision.bf16_pure:
        out += ["        if x.is_floating_point():",
                "            x = x.to(torch.bfloat16)  # bf16 weights take bf16 inputs"]
    return out + ["        return x", "", "    return torch.utils._pytree.tree_map(move, batch)", ""]


def _loop(c: TrainingConfig) -> list[str]:
    dtype = {Precision.bf16: "torch.bfloat16", Precision.fp16: "torch.float16"}.get(c.precision)
    autocast = f"torch.autocast(device.type, dtype={dtype})" if dtype else "nullcontext()"
    sync = "nullcontext()"
    if c.nproc > 1 and c.grad_accum > 1:  # reduce gradients once per optimizer step, not per micro-batch
        sync = ("(nullcontext() if last else model.no_sync())" if c.strategy in (Strategy.ddp, Strategy.zero1)
                else "nullcontext(model.set_requires_gradient_sync(last))" if c.strategy == Strategy.zero3
                # zero2 keeps its gathered parameters until the last micro-batch's backward: one gather a step
                else "nullcontext(model.set_requires_gradient_sync(last) or model.set_reshard_after_backward(last))")
    scaled = "scaler.scale(loss)" if c.precision == Precision.fp16 else "loss"
    out = ["model.train()", "step, micro, epoch = 0, 0, 0", "while step < STEPS:",
           "    if sampler is not None:", "        sampler.set_epoch(epoch)", "    for batch in loader:",
           "        batch = to_device(batch)", "        micro += 1", "        last = micro % GRAD_ACCUM == 0",
           f"        with {sync}, {autocast}:", "            loss = workload.loss_fn(model, batch) / GRAD_ACCUM",
           f"        {scaled}.backward()", "        if not last:", "            continue"]
    if c.precision == Precision.fp16:
        out += ([] if c.fused_backward else ["        scaler.step(optimizer)"]) + ["        scaler.update()"]
    elif not c.fused_backward:
        out.append("        optimizer.step()")
    if not c.fused_backward:
        out.append("        optimizer.zero_grad(set_to_none=True)")
    out += ["        step += 1", "        if step % 10 == 0 or step == STEPS:",
            '            print(f"step {step} loss {loss.item() * GRAD_ACCUM:.4f}", flush=True)',
            "        if step >= STEPS:", "            break", "    epoch += 1"]
    if c.nproc > 1:
        # every rank done with its collectives before any tears the group down (gloo aborted a
        # rank at exit about one run in three without it)
        out += ["dist.barrier()", "dist.destroy_process_group()"]
    if c.nproc > 1 and c.device != "cuda":  # see advisor.trial.GLOO_EXIT_PAUSE_S
        out += ["# gloo's workers free the last backward's collectives only once they hold the GIL; an interpreter",
                "# shutting down ends a worker still waiting for it (SIGABRT at exit): hand them the GIL first",
                "import time", "", f"time.sleep({GLOO_EXIT_PAUSE_S})"]
    return out


def check_data_parallel(config: TrainingConfig) -> None:
    """SpecError where `config` splits the model (tp or pp > 1), which the script cannot do: it runs every
    rank on the whole model, so it would train another configuration than the one chosen."""
    if config.layout().parallel:
        raise SpecError(f"the exported script runs data parallel only, and this configuration splits the model "
                        f"({config.layout().label()}); export it as json, or a trial with tp = pp = cp = 1 and no HSDP")


def python_script(config: TrainingConfig, workload_spec: str, workload_args: dict, *, has_dataset: bool) -> str:
    """The whole script for `config`; `has_dataset`: the workload brings a Dataset (else make_batch).
    SpecError for a config with tp or pp > 1 (check_data_parallel)."""
    check_data_parallel(config)
    from advisor.finetune import FINETUNE_ARG

    parts = [_header(config, workload_spec, workload_args), _process(config),
             _model(config, FINETUNE_ARG in workload_args), _optimizer(config),
             _compile_and_scaler(config), _data(config, has_dataset), _to_device(config), _loop(config)]
    return "\n".join(line for part in parts for line in part) + "\n"
