"""The scratch a CUDA reduction takes from the caching allocator, worked out without a GPU.

torch's reduction kernel (aten/src/ATen/native/cuda/Reduce.cuh, `gpu_reduce_kernel`) splits each
output over several thread blocks when every output has many inputs and there are few outputs to
spread over the device (a "global" reduction). It then takes two blocks from the caching allocator
for the kernel's life: one for the blocks' partial results, `sizeof(arg_t) x outputs x blocks per
output` (x the block's width x the output vector width, where lanes hold separate outputs), and one
of `4 x grid.x` bytes of semaphores. The launch configuration (`setReduceConfig`) follows the
reduction's TensorIterator (its dimensions, after reordering and coalescing), the dtypes, and two
figures of the device: its multiprocessors and the threads each can hold.

The biggest such scratch in training is a linear layer's bias gradient (a sum over the batch rows,
each output a column): 132 MiB for a 2048-wide layer at 32768 rows on an H200, the same in fp32
and bf16, more than the gradient it produces by four orders of magnitude. The fake tensors the
estimator traces on know nothing of it. `reduction_scratch` reproduces `setReduceConfig`'s arithmetic
for NVIDIA GPUs and for ROCm's branches (AMD), so a catalog GPU's estimate counts it; on this
machine's own GPU the estimator measures each reduction instead (`scratch_cuda.cuda_scratch`).

On an H200 (mlp bf16 adamw at batch 32768) the 2048-wide layers' bias gradients take 138,412,032 + 64
bytes and the 10-wide head's 10,240 + 8, as computed here.
Evidence: bench/research/cuda_events.py, bench/results/archive/cuda-events-h200
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

INT32_MAX = 2**31 - 1
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
VT0 = 4  # values per thread per load step: gpu_reduce_kernel's default
VT0_WELFORD = 2  # the variance kernels' (ReduceMomentKernel.cu: fewer registers for Welford's record)


@dataclass(frozen=True)
class ReduceGpu:
    """What a reduction's launch configuration reads from the device."""

    multiprocessors: int  # cudaDeviceProp.multiProcessorCount (SMs; CUs on AMD)
    max_threads_per_multiprocessor: int  # cudaDeviceProp.maxThreadsPerMultiProcessor
    warp_size: int = 32  # 64 on AMD's CDNA GPUs (a wavefront)
    rocm: bool = False  # ROCm builds take other branches in setReduceConfig

    @classmethod
    def of(cls, accelerator: Any) -> ReduceGpu | None:
        """From a catalog entry, or None where the catalog does not give the two figures."""
        if not accelerator.multiprocessors or not accelerator.max_threads_per_multiprocessor:
            return None
        rocm = accelerator.vendor == "amd"
        return cls(accelerator.multiprocessors, accelerator.max_threads_per_multiprocessor,
                   warp_size=64 if rocm else 32, rocm=rocm)

    @classmethod
    def on_device(cls, index: int = 0) -> ReduceGpu:
        """This machine's GPU as torch sees it (a partitioned or cut-down part has fewer multiprocessors than
        its catalog entry)."""
        import torch

        p = torch.cuda.get_device_properties(index)
        return cls(p.multi_processor_count, p.max_threads_per_multi_processor, warp_size=p.warp_size,
                   rocm=torch.version.hip is not None)


def _last_pow2(n: int) -> int:
    """floor(2 ** log2(n)), at least 1 (Reduce.cuh's last_pow2)."""
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Iter:
    """A reduction's TensorIterator after reordering and coalescing: per dimension (fastest first) its
    size, the input's stride and the output's stride, in bytes (0 where the dimension is reduced)."""

    shape: list[int]
    in_strides: list[int]
    out_strides: list[int]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_reduce_dims(self) -> int:
        return sum(s == 0 for s in self.out_strides)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_outputs(self) -> int:
        n = 1
        for s, o in zip(self.shape, self.out_strides):
            if o:
                n *= s
        return n


def _reduction_iter(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, out_itemsize: int,
                    reduced: set[int]) -> _Iter:
    """TensorIterator's view of a reduction of a tensor of `shape`/`strides` (elements) over `reduced`:
    the output is a new contiguous tensor with the reduced dimensions kept as size 1 (stride 0 in the
    iterator); dimensions are sorted fastest first, reduced ones ahead of the rest (`reorder_dimensions`'s
    rule for reductions), then adjacent ones that can be walked as one are merged (`coalesce_dimensions`)."""
    n = len(shape)
    out_stride, acc = [0] * n, out_itemsize
    for d in reversed(range(n)):
        if d not in reduced:
            out_stride[d] = acc
            acc *= shape[d]
    dims = [(shape[d], strides[d] * itemsize, out_stride[d]) for d in range(n)]

    def should_swap(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
        # operands in TensorIterator's order: the output, then the input
        if (a[2] == 0) != (b[2] == 0):
            return 1 if b[2] == 0 else -1  # reduced dimensions to the front
        for sa, sb in ((a[2], b[2]), (a[1], b[1])):
            if sa == 0 or sb == 0:
                continue
            if sa != sb:
                return -1 if sa < sb else 1
            if a[0] > b[0]:
                return 1
        return 0

    # TensorIterator starts from the dimensions reversed (the last one fastest) and sorts them as its
    # `reorder_dimensions` does: each one is compared with those before it, nearest first, and swapped
    # (across any it ties with) with each it should follow, until one it should not
    order = list(reversed(dims))
    for i in range(1, len(order)):
        at = i
        for k in range(i - 1, -1, -1):
            c = should_swap(order[k], order[at])
            if c > 0:
                order[k], order[at] = order[at], order[k]
                at = k
            elif c < 0:
                break
    merged: list[list[int]] = []
    for size, ins, outs in order:
        if merged:
            prev = merged[-1]
            if size == 1 or prev[0] == 1 or (prev[0] * prev[1] == ins and prev[0] * prev[2] == outs):
                if prev[0] == 1:
                    prev[1], prev[2] = ins, outs
                prev[0] *= size
                continue
        merged.append([size, ins, outs])
    return _Iter([m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged])


def _fits_32bit(it: _Iter) -> bool:
    if it.numel > INT32_MAX:
        return False
    for strides in (it.in_strides, it.out_strides):
        if sum((s - 1) * st for s, st in zip(it.shape, strides)) > INT32_MAX:
            return False
    return True


def _first_32bit_part(it: _Iter) -> _Iter:
    """The largest piece `TensorIterator::with_32bit_indexing` cuts: it halves the dimension that spans the
    most bytes until the piece can be indexed in 32 bits (the first half is the larger)."""
    shape = list(it.shape)
    part = _Iter(shape, it.in_strides, it.out_strides)
    while not _fits_32bit(part) and max(shape) > 1:
        d = max(range(len(shape)), key=lambda i: (shape[i] - 1) * max(it.in_strides[i], it.out_strides[i]))
        shape[d] = _div_up(shape[d], 2)
    return part


def _output_vec_size(it: _Iter, itemsize: int, offset_elements: int) -> int:
    """Reduce.cuh's get_output_vec_size: 4 outputs per lane, halved until the input's address, the
    output dimension's size and the other dimensions' input strides are all multiples of it (the
    caching allocator's blocks are 512-byte aligned, so only a view's offset counts)."""
    vec = 4
    output_index = it.num_reduce_dims
    values = [offset_elements, it.shape[output_index]]
    values += [st // itemsize for j, st in enumerate(it.in_strides) if j != output_index]
    for v in values:
        while v % vec:
            vec //= 2
    return vec


def _global_buffer(it: _Iter, arg_bytes: int, itemsize: int, offset_elements: int, gpu: ReduceGpu,
                   vt0: int, input_vec_size: int) -> tuple[int, int]:
    """(the partial results' buffer, the semaphores) in bytes for one launch of `it`; (0, 0) where the
    configuration reduces each output within one block."""
    num_outputs = it.num_outputs
    num_inputs = it.numel // num_outputs
    if it.ndim > 0:
        on_fastest = it.num_reduce_dims == it.ndim or it.in_strides[0] < it.in_strides[it.num_reduce_dims]
        if on_fastest:
            dim0, dim1, fastest = num_inputs, num_outputs, it.in_strides[0]
        else:
            dim0, dim1, fastest = num_outputs, num_inputs, it.in_strides[it.num_reduce_dims]
    else:
        on_fastest, dim0, dim1, fastest = True, 1, 1, itemsize
    output_vec = 1
    if fastest == itemsize:
        vectorize_input = (dim0 >= 128 if gpu.rocm else dim0 > 128 and vt0 >= input_vec_size)
        if on_fastest and vectorize_input and it.num_reduce_dims == 1:
            dim0 //= input_vec_size
        elif not on_fastest:
            output_vec = _output_vec_size(it, itemsize, offset_elements)
            dim0 //= output_vec
    # set_block_dimension (512 threads at most for every dtype but complex double)
    max_threads = 512 // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, gpu.warp_size)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height

    step_input, step_output = 1, 1
    block_x_reduce = it.ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = _div_up(num_inputs, step_input)
    split_across_warps = values_per_thread >= min(block_height * 16, MAX_VALUES_PER_THREAD)
    if gpu.rocm and it.ndim == 2 and on_fastest and values_per_thread < 1024 and gpu.multiprocessors < 100:
        split_across_warps = False
    if not split_across_warps:
        return 0, 0
    step_input *= block_height
    values_per_thread = _div_up(num_inputs, step_input)
    grid_x = _div_up(num_outputs // output_vec, step_output)
    max_threads_per_mp = gpu.max_threads_per_multiprocessor
    if gpu.rocm and not grid_x == 1:  # `uses_a_single_block` there compares bools: true only for a 1 x 1 grid
        max_threads_per_mp = 512 if it.ndim in (1, 3) else 256 if it.ndim == 2 else max_threads_per_mp
    target_grid = gpu.multiprocessors * (max_threads_per_mp // num_threads)
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target_grid:
        return 0, 0
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
               _div_up(values_per_thread, MAX_VALUES_PER_THREAD))
    if gpu.rocm:
        mp = gpu.multiprocessors
        if ctas > mp:
            ctas = mp * (4 if ctas > 512 else 2) if mp < 128 else mp
        elif ctas > _div_up(mp, 2):
            ctas = _div_up(mp, 2)
        elif ctas < 16:
            ctas = 1
        if it.ndim == 3 and not on_fastest:  # (channels-last inputs excepted; not told apart here)
            ctas, vpt = 4, values_per_thread
            while vpt >= 2048:
                ctas *= 2
                vpt = _div_up(num_inputs, step_input * ctas)
    if ctas <= 1:
        return 0, 0
    size = arg_bytes * num_outputs * ctas
    if not block_x_reduce:
        size *= block_width * output_vec
    return size, 4 * grid_x


# sizeof(arg_t), the kernel's accumulator, by op family and input dtype (Reduce*Kernel.cu): sums, means
# and norms accumulate in float for 16- and 32-bit floats; max/min with an index carry a (value, int64)
# pair; Welford's variance a (mean, m2, int32 n, nf) record; amax/amin keep the input's type.
def _arg_bytes(family: str, dtype: Any) -> int:
    import torch

    wide = dtype in (torch.float64, torch.complex128)
    if family == "any":
        return 1
    if family == "extreme":
        return dtype.itemsize
    if family == "indexed":
        return 16
    if family == "welford":
        return 32 if wide else 16
    if dtype.is_complex:
        return 16 if wide else 8
    if not dtype.is_floating_point:
        return 8  # integer sums accumulate in int64
    return 8 if wide else 4


@functools.lru_cache(maxsize=1)
def _families() -> dict[Any, str]:
    import torch

    aten = torch.ops.aten
    return {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "sum", aten.mean.dim: "sum",
            aten.nansum.default: "sum", aten.prod.default: "sum", aten.prod.dim_int: "sum",
            aten.linalg_vector_norm.default: "sum", aten.amax.default: "extreme", aten.amin.default: "extreme",
            aten.max.dim: "indexed", aten.min.dim: "indexed", aten.argmax.default: "indexed",
            aten.argmin.default: "indexed", aten.var.correction: "welford", aten.std.correction: "welford",
            aten.var_mean.correction: "welford", aten.std_mean.correction: "welford", aten.any.dim: "any",
            aten.all.dim: "any"}


def is_reduction(func: Any) -> bool:
    return func in _families()


@dataclass(frozen=True)
class ReduceSpec:
    """What decides a reduction's scratch: the op family, its input's shape, strides (elements) and offset, the
    dimensions it reduces, and the input's and output's dtypes."""

    family: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    reduced: tuple[int, ...]
    in_dtype: Any
    out_dtype: Any

    def at(self, other: ReduceSpec, f: float) -> ReduceSpec | None:
        """The same reduction at a batch size between (or past) this one's, `other`'s at fraction `f` of the way
        (shapes and strides are affine in the batch, as the batch model takes every tensor to be); None where the
        two are not the same reduction."""
        if (self.family, self.reduced, self.in_dtype, self.out_dtype) != \
                (other.family, other.reduced, other.in_dtype, other.out_dtype) or len(self.shape) != len(other.shape):
            return None

        def lerp(xs: tuple[int, ...], ys: tuple[int, ...], low: int) -> tuple[int, ...]:
            return tuple(max(low, round(x + f * (y - x))) for x, y in zip(xs, ys))

        return replace(self, shape=lerp(self.shape, other.shape, 1), strides=lerp(self.strides, other.strides, 0),
                       offset=lerp((self.offset,), (other.offset,), 0)[0])


def reduction_spec(func: Any, args: tuple, kwargs: dict, out: Any) -> ReduceSpec | None:
    """`func(*args, **kwargs)` (a reduction in `_families`, its output `out`) as a ReduceSpec; None for an empty
    input."""
    import torch
    from torch.utils._pytree import tree_flatten

    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    x = bound.get("self")
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return None
    dim = bound.get("dim")
    if dim is None or dim == []:
        reduced = tuple(range(x.dim()))
    else:
        reduced = tuple(sorted({d % max(x.dim(), 1) for d in ([dim] if isinstance(dim, int) else dim)}))
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    # a sum of 16-bit floats into float32 (dtype=) reads them as they are on CUDA: the input's dtype
    return ReduceSpec(_families()[func], tuple(x.shape), tuple(x.stride()), x.storage_offset(), reduced, x.dtype,
                      outs[0].dtype if outs else x.dtype)


def reduction_scratch(func: Any, args: tuple, kwargs: dict, out: Any, gpu: ReduceGpu) -> list[int]:
    """The blocks `func(*args, **kwargs)` (a reduction in `_families`, its output `out`) takes from the caching
    allocator inside the op on `gpu`, in the order it takes them: its partial results and semaphores
    where it reduces across blocks, and before them an accumulation buffer where a 16-bit output over
    more than 2**31 elements cannot be accumulated in place; [] where it takes none."""
    spec = reduction_spec(func, args, kwargs, out)
    return [n for n in scratch_slots(spec, gpu) if n] if spec else []


@functools.lru_cache(maxsize=4096)  # a model's layers repeat a few shapes
def scratch_slots(spec: ReduceSpec, gpu: ReduceGpu) -> tuple[int, int, int]:
    """(accumulation buffer, partial results, semaphores) in bytes, 0 for each the op does not take: the
    same three slots for every reduction, so that two traces' allocations keep their order."""
    import torch

    in_dtype, out_dtype = spec.in_dtype, spec.out_dtype
    it = _reduction_iter(spec.shape, spec.strides, in_dtype.itemsize, out_dtype.itemsize, set(spec.reduced))
    arg_bytes = _arg_bytes(spec.family, in_dtype)
    vt0 = VT0_WELFORD if spec.family == "welford" else VT0
    # ROCm packs 16-bit sums eight to a load (ReduceSumProdKernel.cu)
    input_vec = 8 if gpu.rocm and spec.family == "sum" and in_dtype.itemsize == 2 else vt0
    accumulation = 0
    if not _fits_32bit(it):
        if out_dtype in (torch.float16, torch.bfloat16) and in_dtype == out_dtype:
            span = max([out_dtype.itemsize] + [s * st for s, st in zip(it.shape, it.out_strides)])
            accumulation = span // out_dtype.itemsize * arg_bytes
        it = _first_32bit_part(it)
    buffer, semaphores = _global_buffer(it, arg_bytes, in_dtype.itemsize, spec.offset, gpu, vt0, input_vec)
    return accumulation, buffer, semaphores
