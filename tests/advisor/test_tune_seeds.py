"""The planner's fastest plans as the tuner's first trials after the baseline: on GPUs, for a decoder whose space
searches its layout, each plan's layout as the space draws it; nothing elsewhere."""

from __future__ import annotations

import pytest

from advisor.hardware import get_hardware
from advisor.plan.knobs import FixedKnobs
from advisor.plan.model import PlanRequest
from advisor.plan.search import plan
from advisor.presets import get_preset
from advisor.tune.seeds import planner_seeds
from advisor.workload import WorkloadInfo
from search_spaces import SearchSpace, SpaceContext, baseline, load_space

LAYOUT = ("tp", "pp", "cp", "strategy", "dp_replicate", "checkpointing", "precision")


@pytest.fixture(scope="module")
def llama_8b() -> WorkloadInfo:
    return WorkloadInfo.of(get_preset("llama-8b")())


def test_the_planners_top_layouts_come_first_as_the_space_draws_them(llama_8b: WorkloadInfo) -> None:
    hw = get_hardware("h100-sxm:8")
    context = SpaceContext.for_target(hw, llama_8b)
    space, base = load_space("default"), baseline(context)
    seeds = planner_seeds(llama_8b.decoder, hw, space, context, base)
    assert 1 <= len(seeds) <= 3
    top = plan(PlanRequest(arch=llama_8b.decoder, hardware=["h100-sxm:8x1"], top=12,
                           fixed=FixedKnobs(optimizer=base.optimizer))).plans
    planned = [tuple(getattr(p.config, k) for k in LAYOUT) for p in top]
    for seed in seeds:
        assert seed.device == "cuda" and seed.nproc == 8 and seed != base
        assert tuple(getattr(seed, k) for k in LAYOUT) in planned
        assert seed.batch_size in (2, 4, 8, 16)  # the space's batch sizes, at most the plan's
    # fastest first: the first seed is the fastest plan the space can draw
    assert tuple(getattr(seeds[0], k) for k in LAYOUT) == next(p for p in planned if p in
                                                               [tuple(getattr(s, k) for k in LAYOUT) for s in seeds])


def test_no_seeds_off_gpus_without_a_decoder_or_a_layout_to_search(llama_8b: WorkloadInfo) -> None:
    space = load_space("default")
    cpu = get_hardware("cpu")
    context = SpaceContext.for_target(cpu, llama_8b)
    assert planner_seeds(llama_8b.decoder, cpu, space, context, baseline(context)) == []
    gpus = get_hardware("h100-sxm:8")
    context = SpaceContext.for_target(gpus, llama_8b)
    assert planner_seeds(None, gpus, space, context, baseline(context)) == []
    no_layout = SearchSpace(name="threads-only", knobs={"num_workers": {"choices": [0, 2]}})
    assert planner_seeds(llama_8b.decoder, gpus, no_layout, context, baseline(context)) == []
