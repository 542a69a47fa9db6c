"""Building a workload's model and batches on fake tensors: the torch and user code a fake build runs into,
and what a CUDA target's `.to("cuda")` moves to the device."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable

from advisor.workload import Workload

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker


def moved_to_device(obj: Any, tracker: Tracker) -> Any:
    """What `.to("cuda")` puts on the device, recorded in its order; returns the batch on the device (a module
    stays as it is). A module's parameters and buffers as `Module._apply` walks them (each child's first, depth
    first, then its own parameters, then its buffers), each storage once: a weight tied to another is moved
    with it. A batch's tensors in pytree order, each copied (two views of one CPU tensor are two copies).
    Nothing made on the CPU before is on the device: an initializer's scratch, or a tied layer's own weight,
    replaced in its constructor."""
    import torch
    from torch.utils._pytree import tree_map

    if isinstance(obj, torch.nn.Module):
        def walk(m: torch.nn.Module) -> None:
            for child in m.children():
                walk(child)
            for t in (*m._parameters.values(), *m._buffers.values()):
                tracker.track(t)

        walk(obj)
        return obj
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def _data_dependent(exc: BaseException) -> bool:
    """Whether `exc` is fake tensors refusing an op whose output shape or result depends on a tensor's
    values (nonzero, repeat_interleave with tensor repeats, int() of a tensor)."""
    return any(word in type(exc).__name__ for word in ("DataDependent", "DynamicOutputShape"))


def build_batch(workload: Workload, batch_size: int, fake_mode) -> Any:
    """The workload's batch: under `fake_mode`, built there where its code lets it, else built for real
    outside it and made fake (`_fakeify`). A make_batch that reads values to build its tensors (a graph
    batch's node-to-graph index by repeat_interleave of the graphs' sizes, a packed sequence's positions)
    then costs its batch in real memory, the inputs only, and not a real-step fallback for the whole
    model."""
    if fake_mode is None:
        return workload.make_batch(batch_size)
    try:
        batch = workload.make_batch(batch_size)
    except Exception as exc:  # noqa: BLE001 - only a data-dependent refusal is retried; the rest re-raised
        if not _data_dependent(exc):
            raise
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            batch = workload.make_batch(batch_size)
    return _fakeify(batch, fake_mode)


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


class BuildReadsValues(Exception):
    """The model's build read a fake tensor's value (`build_model`)."""


_INIT_SKIPPED = threading.Lock()  # one skipped build at a time: the module's attributes are process-wide
_VALIDATION = threading.RLock()  # a trace within a trace in one thread would not wait on itself


@contextlib.contextmanager
def _initializers_skipped():
    """torch.nn.init's in-place initializers (trunc_normal_, kaiming_uniform_, ...) as no-ops that hand back
    their tensor, for as long as one fake build takes: modules' reset_parameters and users' init code call
    them through the module. A real model built in another thread meanwhile would be left uninitialized;
    the estimator builds none (trials and calibration runs are processes of their own). transformers (5.x)
    calls them through a table of torch's functions it took at import (transformers.initialization's
    TORCH_INIT_FUNCTIONS), which the same no-op replaces while it lasts, where transformers is loaded."""
    import torch.nn.init as init

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    hf_table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_table = hf_table if isinstance(hf_table, dict) else {}

    def keep(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - any initializer's signature
        return tensor

    with _INIT_SKIPPED:
        saved = {n: getattr(init, n) for n in names}
        hf_saved = dict(hf_table)
        try:
            for n in names:
                setattr(init, n, keep)
            hf_table.update(dict.fromkeys(hf_saved, keep))
            yield
        finally:
            for n, f in saved.items():
                setattr(init, n, f)
            hf_table.update(hf_saved)


_CONVERTING = threading.local()  # `fake_conversions`: set in the thread whose fake trace is running


@contextlib.contextmanager
def fake_conversions():
    """nn.Module.to/.half()/.bfloat16() and a memory format (`_apply`) on fake parameters, as on real ones:
    torch 2.13 swaps a fake parameter with its converted copy (torch.utils.swap_tensors), and the swap
    refuses a tensor that a weak reference points to, which fake ones have: the estimator's own pure-bf16
    cast (advisor.training.prepare) and a build's `.half()` would raise. While this thread traces, a swap of
    two fake tensors sets the parameter's data to the copy's instead, what `_apply` does to real ones (the
    parameter object kept, its old storage freed); any other swap, and every swap in other threads, goes
    torch's way."""
    import torch
    import torch.utils
    from torch._subclasses.fake_tensor import FakeTensor

    with _INIT_SKIPPED:  # installed once in the process
        if not getattr(torch.utils.swap_tensors, "_advisor_fake_data", False):
            original = torch.utils.swap_tensors

            def swap(t1, t2):  # noqa: ANN001, ANN202 - torch.utils.swap_tensors' signature
                if getattr(_CONVERTING, "on", False) and isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
                    with torch.no_grad():
                        t1.data = t2.data
                    return None
                return original(t1, t2)

            swap._advisor_fake_data = True
            torch.utils.swap_tensors = swap
    _CONVERTING.on = True
    try:
        yield
    finally:
        _CONVERTING.on = False


@contextlib.contextmanager
def distribution_checks_off():
    """torch.distributions' argument checks off for a fake trace, as `Distribution.set_default_validate_args(False)`
    sets them: each checks its parameters' values (`if not valid.all(): raise`), which fake tensors do not have,
    so a VAE, a policy or a flow that builds a Normal (validating by default) would fall back to real steps.
    A check allocates a boolean per element while it runs and changes nothing else; one given
    validate_args=True still checks, and still falls back. Process-wide while it lasts, as the initializers'
    skip is: a distribution made in another thread meanwhile goes unchecked, and another thread's fake trace
    waits for this one (Python's lock on the interpreter runs one at a time anyway)."""
    from torch.distributions import Distribution

    with _VALIDATION:
        saved = Distribution._validate_args
        Distribution.set_default_validate_args(False)
        try:
            yield
        finally:
            Distribution.set_default_validate_args(saved)


def build_model(workload: Workload, fake_mode: Any, skip_init: bool, precision: Any = None) -> Any:
    """`workload.build_model()`, its tensors made this fake mode's (`_adopt_copies`) where it is one; on
    fake tensors, a build that reads a tensor's value raises BuildReadsValues for `trace_training` to
    build again with the initializers skipped. With `precision`, a fine-tune's frozen base is held in the
    dtype that precision gives it (advisor.finetune.hold_frozen), as a trial builds it."""
    try:
        with _initializers_skipped() if skip_init else contextlib.nullcontext(), warnings.catch_warnings():
            # copy.deepcopy of a fake parameter asks for its data pointer (torch/_tensor.py): torch's warning
            # is about that check, not the user's code
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            fake = fake_mode is not None
            with (_fresh_copies() if fake else contextlib.nullcontext(),
                  _lazy_on_fake() if fake else contextlib.nullcontext()):
                model = workload.build(lambda n: build_batch(workload, n, fake_mode))
    except Exception as exc:
        if fake_mode is not None and not skip_init and "DataDependent" in type(exc).__name__:
            raise BuildReadsValues(str(exc)) from exc
        raise
    if precision is not None:
        from advisor.finetune import hold_frozen

        model = hold_frozen(model, precision)
    return _adopt_copies(model, fake_mode) if fake_mode is not None else model


@contextlib.contextmanager
def _lazy_on_fake() -> Any:
    """For the build on fake tensors: lazy modules (nn.LazyLinear, LazyConv2d, LazyBatchNorm2d, ...). torch 2.13
    cannot make their uninitialized parameters and buffers over a fake tensor (UninitializedParameter's
    `_make_subclass` raises on one), and a materialized one keeps the real object, which cannot become fake. Here
    each is made real and empty (no bytes) until
    the module's first forward (`Workload.build` runs one on a batch of 2), where the shape it infers is made a
    fake tensor of the trace's mode and put in the module's table in its place. Outside a lazy module's first
    forward in this build, torch's own `materialize` runs. Process-wide while it lasts, under the lock that
    `distribution_checks_off` takes: another thread's fake trace waits."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.modules.lazy import LazyModuleMixin
    from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin

    new_param, new_buffer = UninitializedParameter.__new__, UninitializedBuffer.__new__
    materialize, infer = UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters
    inferring: list[Any] = []  # the lazy modules whose first forward is running, innermost last

    def made_real(new: Callable[..., Any]) -> Callable[..., Any]:
        def make(cls: type, *args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return new(cls, *args, **kwargs)
        return make

    def fake_in_place(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
        owner = inferring[-1] if inferring else None
        tables = (owner._parameters, owner._buffers) if owner is not None else ()
        found = next(((t, k) for t in tables for k, v in t.items() if v is self), None)
        if found is None:
            return materialize(self, shape, device, dtype)
        with unset_fake_temporarily():
            device, dtype = device or self.device, dtype or self.dtype
        made = torch.empty(shape, device=device, dtype=dtype)
        table, name = found
        table[name] = torch.nn.Parameter(made, requires_grad=self.requires_grad) \
            if isinstance(self, UninitializedParameter) else made

    def first_forward(self: Any, module: Any, args: Any, kwargs: Any = None) -> Any:
        inferring.append(module)
        try:
            return infer(self, module, args, kwargs)
        finally:
            inferring.pop()

    with _VALIDATION:
        UninitializedParameter.__new__, UninitializedBuffer.__new__ = made_real(new_param), made_real(new_buffer)
        UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters = fake_in_place, first_forward
        try:
            yield
        finally:
            UninitializedParameter.__new__, UninitializedBuffer.__new__ = new_param, new_buffer
            UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters = materialize, infer


def _fresh_copies() -> Any:
    """A torch function mode for the build on fake tensors: `copy.deepcopy` of a fake tensor makes an empty
    one of the trace's mode with its shape, strides, dtype and requires_grad (values are not traced), where
    torch's own deep copy of a plain tensor tries to copy its storage. For a fake tensor made from data, as
    `torch.tensor(0)` makes BatchNorm's num_batches_tracked, that raises and leaves glibc's heap corrupt, so a
    deep copy of a module holding a BatchNorm (the momentum encoder of MoCo, BYOL or DINO, a model's EMA copy)
    would fail. A parameter's copy is a parameter."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.overrides import TorchFunctionMode

    class FreshCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not torch.Tensor.__deepcopy__ or not isinstance(args[0], FakeTensor):
                return func(*args, **(kwargs or {}))
            t, memo = args
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            if isinstance(t, torch.nn.Parameter):  # a fake parameter is a FakeTensor marked as one
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            elif t.requires_grad:
                new.requires_grad_()
            memo[id(t)] = new
            return new

    return FreshCopies()


def _adopt_copies(model: Any, fake_mode: Any) -> Any:
    """The model's parameters and buffers that belong to another fake mode, as fake tensors of this one: a
    build can keep one from another trace in the process (a buffer from a module-level cache). An op on such a
    tensor converts it afresh, with a storage of its own each time, which the trace would take for a new
    allocation at every use. Each is replaced by an empty tensor of this mode with its shape, strides and dtype (values
    are not traced), made in the trace's mode so it is tracked, the old one freed; a tensor shared by several
    modules stays shared."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    adopted: dict[int, Any] = {}

    def own(t: Any) -> Any:
        if not isinstance(t, FakeTensor) or t.fake_mode is fake_mode:
            return t
        if id(t) not in adopted:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            adopted[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else new
        return adopted[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                table[name] = own(t)
    return model

