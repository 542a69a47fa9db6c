"""Trace two real training steps on fake tensors and record every storage allocation and free.

Nothing is allocated: the model is built and stepped under FakeTensorMode, so any nn.Module is
covered, whatever its size. A TorchDispatchMode above the fake mode sees each aten op's outputs;
a weakref finalizer on each new storage tells when it dies. Replaying the log gives the live
bytes after every event, split by what each allocation is for (the categories below).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.errors import EstimateError
from advisor.workload import Workload

# Category indices of the live-bytes curve.
# PARAM_COPIES: low-precision copies of parameters made in forward (autocast's weight cache);
# under ZeRO-3 they exist only for the gathered units, so they scale with the parameters.
PARAMS, GRADS, OPT_STATE, ACTIVATIONS, TEMPORARIES, STEP_TEMPS, INPUTS, PARAM_COPIES = range(8)
CATEGORY_NAMES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "step_temporaries", "inputs",
                  "param_copies")
_PHASE_LABEL = {"build": PARAMS, "batch": INPUTS, "forward": ACTIVATIONS, "backward": TEMPORARIES,
                "step": STEP_TEMPS, "done": TEMPORARIES}


@dataclass
class Trace:
    """What one traced run (build + 2 steps) allocated, as a curve of live bytes by category."""

    curve: np.ndarray  # (events, 8) int64: live bytes per category after each event
    sizes: np.ndarray  # (events,) int64: +bytes for an allocation, -bytes for a free, in order
    ids: np.ndarray  # (events,) int64: which allocation each event is about
    param_bytes: int  # parameters and buffers (bytes)
    grad_bytes: int  # gradients alive at once at the optimizer step (bytes); fused step: largest one
    opt_state_bytes: int  # optimizer state after the second step (bytes)
    largest_block_bytes: int  # parameters of the largest repeated block (bytes): FSDP's unit
    flops_per_step: int  # forward + backward FLOPs of one step (torch.utils.flop_counter)
    num_params: int
    seconds: float
    synthetic: bool = False  # built from formulas: sizes are moments, not an allocation sequence

    @property
    def peak_bytes(self) -> int:
        return int(self.curve.sum(axis=1).max()) if len(self.curve) else 0


class _Tracker:
    """Records storage allocations/frees seen through dispatch; labels them by phase."""

    def __init__(self) -> None:
        self.phase = "build"
        self.live_ids: dict[int, int] = {}  # storage pointer -> allocation id
        self.labels: list[int] = []  # allocation id -> category
        self.nbytes: list[int] = []  # allocation id -> bytes
        self.events: list[int] = []  # +(id+1) alloc, -(id+1) free
        self.flops = 0
        self.count_flops = False
        self.param_keys: set[int] = set()  # storages of the model's parameters

    def set_phase(self, name: str) -> None:
        self.phase = name

    def track(self, t: Any, category: int | None = None) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live_ids:
            return
        aid = len(self.nbytes)
        self.live_ids[key] = aid
        self.nbytes.append(int(st.nbytes()))
        self.labels.append(_PHASE_LABEL[self.phase] if category is None else category)
        self.events.append(aid + 1)
        weakref.finalize(st, self._free, key, aid)

    def _free(self, key: int, aid: int) -> None:
        if self.live_ids.get(key) == aid:
            del self.live_ids[key]
        self.events.append(-(aid + 1))

    def relabel(self, t: Any, category: int) -> None:
        aid = self.live_ids.get(t.untyped_storage()._cdata)
        if aid is not None:
            self.labels[aid] = category


def _dispatch_mode(tracker: _Tracker):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class TrackingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            category = None
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and args[0].untyped_storage()._cdata in tracker.param_keys):
                category = PARAM_COPIES
            if isinstance(out, torch.Tensor):  # the common case, without pytree's cost
                tracker.track(out, category)
            else:
                for t in tree_flatten(out)[0]:
                    tracker.track(t, category)
            if tracker.count_flops and func.overloadpacket in flop_registry:
                tracker.flops += int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            return out

    return TrackingMode()


def _fakeify(batch: Any, fake_mode) -> Any:
    """Real tensors a make_batch built outside dispatch (e.g. from numpy) become fake ones."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            return fake_mode.from_tensor(x)
        return x

    return tree_map(conv, batch)


def _replay(tracker: _Tracker) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels = np.asarray(tracker.labels, dtype=np.int64)
    nbytes = np.asarray(tracker.nbytes, dtype=np.int64)
    ev = np.asarray(tracker.events, dtype=np.int64)
    ids = np.abs(ev) - 1
    signed = np.where(ev > 0, nbytes[ids], -nbytes[ids])
    onehot = np.zeros((len(ev), len(CATEGORY_NAMES)), dtype=np.int64)
    onehot[np.arange(len(ev)), labels[ids]] = signed
    return np.cumsum(onehot, axis=0), signed, ids


def trace_training(workload: Workload, batch_size: int, *, precision: Precision, optimizer: OptimizerKind,
                   checkpointing: bool = False, fused_backward: bool = False, optimizer_impl: str | None = None,
                   fake: bool = True, count_flops: bool = True) -> Trace:
    """Build `workload` and run two full training steps, recording memory.

    fake=True (the estimator): on fake tensors, nothing allocated. fake=False: on real CPU
    tensors, so real kernels choose their own paths (e.g. oneDNN's RNN with its workspace);
    the calibration runs this at small batch sizes in a fresh process.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.training import prepare, repeated_blocks, train_step

    t0 = time.perf_counter()
    tracker = _Tracker()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    try:
        with fake_mode or contextlib.nullcontext(), _dispatch_mode(tracker):
            torch.manual_seed(0)
            model = workload.build_model()
            params = [p for p in model.parameters()]
            num_params = sum(p.numel() for p in params)
            blocks = repeated_blocks(model)
            block_bytes = max((sum(p.nbytes for p in b.parameters()) for b in blocks), default=0)
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda q: tracker.relabel(q.grad, GRADS))
            ctx = prepare(model, workload.loss_fn, precision=precision, optimizer=optimizer, device_type="cpu",
                          optimizer_impl=optimizer_impl, checkpointing=checkpointing, fused_backward=fused_backward,
                          fake=fake)
            param_bytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
            tracker.param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
            grad_bytes = 0
            for it in range(2):
                tracker.set_phase("batch")
                batch = workload.make_batch(batch_size)
                batch = _fakeify(batch, fake_mode) if fake_mode else batch
                for t in torch.utils._pytree.tree_flatten(batch)[0]:
                    tracker.track(t)
                tracker.count_flops = count_flops and it == 0

                def on_phase(name: str) -> None:
                    nonlocal grad_bytes
                    tracker.set_phase(name)
                    if name == "step":
                        grads = [p.grad for p in model.parameters() if p.grad is not None]
                        grad_bytes = max(grad_bytes, sum(g.nbytes for g in grads))
                    if name == "done":
                        tracker.count_flops = False
                        for opt in ctx.optimizers:
                            for state in opt.state.values():
                                for v in state.values():
                                    if isinstance(v, torch.Tensor):
                                        tracker.relabel(v, OPT_STATE)

                train_step(ctx, batch, phase=on_phase)
                del batch
            opt_state_bytes = sum(v.nbytes for opt in ctx.optimizers for s in opt.state.values()
                                  for v in s.values() if isinstance(v, torch.Tensor))
            if fused_backward:
                grad_bytes = max((p.nbytes for p in model.parameters()), default=0)
    except EstimateError:
        raise
    except Exception as exc:
        if "DataDependent" in type(exc).__name__:
            raise EstimateError(f"cannot trace {workload.name} on fake tensors: its code reads a tensor's value "
                                f"(data-dependent control flow, {type(exc).__name__})") from exc
        raise EstimateError(f"cannot trace {workload.name} on {'fake' if fake else 'real'} tensors: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    curve, sizes, ids = _replay(tracker)
    return Trace(curve=curve, sizes=sizes, ids=ids, param_bytes=int(param_bytes),
                 grad_bytes=int(grad_bytes), opt_state_bytes=int(opt_state_bytes), largest_block_bytes=int(block_bytes),
                 flops_per_step=tracker.flops, num_params=int(num_params), seconds=time.perf_counter() - t0)


def save_trace(trace: Trace, path: str) -> None:
    """Write a trace to an .npz file (the calibration process hands traces back this way)."""
    meta = {k: getattr(trace, k) for k in ("param_bytes", "grad_bytes", "opt_state_bytes", "largest_block_bytes",
                                           "flops_per_step", "num_params", "seconds")}
    np.savez(path, curve=trace.curve, sizes=trace.sizes, ids=trace.ids, meta=np.asarray(list(meta.values()), dtype=np.float64))


def load_trace(path: str) -> Trace:
    with np.load(path) as z:
        m = z["meta"].tolist()
        return Trace(curve=z["curve"], sizes=z["sizes"], ids=z["ids"], param_bytes=int(m[0]),
                     grad_bytes=int(m[1]), opt_state_bytes=int(m[2]), largest_block_bytes=int(m[3]),
                     flops_per_step=int(m[4]), num_params=int(m[5]), seconds=float(m[6]))
