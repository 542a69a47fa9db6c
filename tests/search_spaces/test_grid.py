"""`grid` and `baseline` on a CPU and on 8 catalog GPUs: every configuration meets the conditions,
and the grid holds exactly the combinations the space and the target allow."""

from __future__ import annotations

from collections import Counter

import pytest

from advisor.errors import SpecError
from advisor.hardware import get_hardware
from search_spaces import SpaceContext, apply_fixes, baseline, get_space, grid, load_space
from search_spaces.sample import Plan

from space_checks import violations


@pytest.mark.parametrize("name", ["tiny", "quick", "default"])
@pytest.mark.parametrize("target", ["cpu_ctx", "gpu_ctx"])
def test_every_grid_config_meets_the_conditions(name, target, request):
    ctx = request.getfixturevalue(target)
    configs = grid(get_space(name), ctx)
    assert configs and len(set(configs)) == len(configs)
    bad = [(c, v) for c in configs if (v := violations(c, ctx))]
    assert not bad, bad[:3]
    assert {c.device for c in configs} == {ctx.device}


def test_the_8_gpu_default_grid_uses_what_the_gpus_allow(gpu_ctx):
    configs = grid(get_space("default"), gpu_ctx)
    seen = Counter((c.strategy.value, c.precision.value) for c in configs)
    assert {s for s, _ in seen} == {"single", "ddp", "zero2", "zero3"}
    assert {p for _, p in seen} == {"fp32", "tf32", "bf16", "fp16"}
    assert any(c.pin_memory for c in configs) and any(c.compile_mode.value == "reduce-overhead" for c in configs)
    assert {c.prefetch_factor for c in configs if c.num_workers} == {2, 4}
    assert all(c.persistent_workers for c in configs if c.num_workers)
    assert any(c.fused_backward for c in configs)
    assert not any(c.channels_last for c in configs)  # not a conv net


def test_the_cpu_default_grid_drops_cuda_only_values(cpu_ctx):
    configs = grid(get_space("default"), cpu_ctx)
    # the nominal CPU has no bf16 units: bf16 would run emulated, slower than fp32, so not searched
    assert {c.precision.value for c in configs} == {"fp32"}
    assert {c.compile_mode.value for c in configs} == {"none", "default"}
    assert {c.strategy.value for c in configs} == {"single"}
    # 7 batches x (1 + 3 worker counts x 2 prefetch) x 1 precision x 2 compile x 2 impl
    # x fused_backward (2 unless fp16: always 2 here) x 2 checkpointing
    assert len(configs) == 7 * 7 * 1 * 2 * 2 * 2 * 2


def test_fast_bf16_by_target():
    from advisor.hardware.sysinfo import cpu_has_bf16_units

    def fast(spec: str) -> bool:
        hw = get_hardware(spec)
        return SpaceContext(hardware=hw, device_count=hw.devices_per_node, default_batch_size=8).facts()["fast_bf16"]

    assert fast("h100-sxm") and fast("a100-80gb:2") and not fast("v100")  # tensor cores for bf16, or no bf16
    assert not fast("cpu:1")  # the nominal AVX2 socket: bf16 runs there, emulated
    assert fast("cpu") == cpu_has_bf16_units()  # this machine's CPU, by its flags


def test_bf16_is_searched_on_a_cpu_with_bf16_units(cpu):
    ctx = SpaceContext(hardware=cpu, device_count=1, default_batch_size=8, fast_bf16=True)  # e.g. AMX
    for space in ("quick", "default"):
        assert {c.precision.value for c in grid(get_space(space), ctx)} == {"fp32", "bf16"}
    # without units it is advisory: a user who fixes bf16 gets it
    fixed = grid(apply_fixes(get_space("default"), {"precision": "bf16"}), SpaceContext(
        hardware=cpu, device_count=1, default_batch_size=8))
    assert fixed and {c.precision.value for c in fixed} == {"bf16"}
    # the exhaustive space tries bf16 wherever it runs at all, units or not
    plain = SpaceContext(hardware=cpu, device_count=1, default_batch_size=8)
    assert "bf16" in Plan(get_space("exhaustive"), plain).domain("precision").values


def test_exact_tiny_grids(cpu_ctx, gpu_ctx):
    cpu = grid(get_space("tiny"), cpu_ctx)
    assert len(cpu) == 2 * 2 * 2  # batch x workers x {fp32, bf16}
    gpu = grid(get_space("tiny"), gpu_ctx)
    assert len(gpu) == 2 * 2 * 2 * 2 * 3  # strategy x batch x workers x pin x precision
    assert {c.nproc for c in gpu if c.strategy.value == "ddp"} == {8}


def test_conv_nets_get_channels_last(gpus8):
    ctx = SpaceContext(hardware=gpus8, conv_net=True, device_count=8, default_batch_size=8)
    space = get_space("default")
    assert {c.channels_last for c in grid(space, ctx)} == {False, True}


def test_bf16_only_where_supported(tmp_path):
    v100 = get_hardware("v100:2")
    assert not v100.accelerator.supports_bf16
    ctx = SpaceContext(hardware=v100, device_count=2, default_batch_size=8)
    configs = grid(get_space("tiny"), ctx)
    assert {c.precision.value for c in configs} == {"fp32", "fp16"}
    assert all(not violations(c, ctx) for c in configs)


def test_batch_bounds_follow_the_workload(cpu):
    for default, expected in ((8, [2, 4, 8, 16, 32, 64]), (128, [32, 64, 128, 256, 512, 1024])):
        ctx = SpaceContext(hardware=cpu, device_count=1, default_batch_size=default)
        assert sorted({c.batch_size for c in grid(get_space("quick"), ctx)}) == expected


def test_threads_range_uses_the_core_count(cpu):
    ctx = SpaceContext(hardware=cpu.model_copy(update={"cpu_cores": 4}), device_count=1, default_batch_size=8)
    assert Plan(get_space("exhaustive"), ctx).domain("threads").values == (1, 2, 4)
    # On a target with no known core count the condition keeps threads at torch's default.
    unknown = SpaceContext(hardware=cpu, device_count=1, default_batch_size=8)
    assert Plan(get_space("exhaustive"), unknown).pending("threads", {}) == (None, None)


@pytest.mark.parametrize("g", [64, 16, 12])
def test_global_batch_derives_grad_accum(gpu_ctx, g):
    ctx = gpu_ctx.model_copy(update={"global_batch_size": g})
    configs = grid(get_space("tiny"), ctx)
    assert configs and all(not violations(c, ctx) for c in configs)
    pairs = {(c.strategy.value, c.batch_size, c.grad_accum) for c in configs}
    expected = {64: {("single", 4, 16), ("single", 8, 8), ("ddp", 4, 2), ("ddp", 8, 1)},
                16: {("single", 4, 4), ("single", 8, 2)},  # 4 x 8 ranks > 16: ddp cannot reach it
                12: {("single", 4, 3)}}[g]  # 8 does not divide 12
    assert pairs == expected


def test_grad_accum_in_the_space_conflicts_with_a_global_batch(tmp_path, gpu_ctx):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nknobs:\n  grad_accum: {choices: [1, 2]}\n")
    ctx = gpu_ctx.model_copy(update={"global_batch_size": 64})
    with pytest.raises(SpecError, match="derives it"):
        grid(load_space(str(path)), ctx)
    assert {c.grad_accum for c in grid(load_space(str(path)), gpu_ctx)} == {1, 2}


def test_a_space_that_yields_invalid_configs_says_so(tmp_path, cpu_ctx):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nknobs:\n  num_workers: {choices: [0, 2]}\n  prefetch_factor: {fixed: 2}\n")
    with pytest.raises(SpecError, match="prefetch_factor needs num_workers >= 1.*add a condition"):
        grid(load_space(str(path)), cpu_ctx)


def test_the_exhaustive_grid_is_too_large_and_says_what_to_do(gpu_ctx):
    with pytest.raises(SpecError, match="--fix"):
        grid(get_space("exhaustive"), gpu_ctx, limit=10_000)


def test_baseline_is_pytorch_defaults(cpu_ctx, gpu_ctx):
    b = baseline(cpu_ctx)
    assert (b.batch_size, b.grad_accum, b.precision.value, b.compile_mode.value, b.num_workers, b.pin_memory,
            b.strategy.value, b.nproc, b.device) == (8, 1, "fp32", "none", 0, False, "single", 1, "cpu")
    assert baseline(gpu_ctx).device == "cuda"
    fixed = baseline(cpu_ctx.model_copy(update={"global_batch_size": 12}))
    assert (fixed.batch_size, fixed.grad_accum) == (6, 2)
