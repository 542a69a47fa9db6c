"""Tests for the catalog's communication figures and HardwareSpec.link_for (advisor.hardware)."""

from __future__ import annotations

import pytest

from advisor.hardware import CATALOG, Accelerator, HardwareSpec, Link, get_hardware

LINK_FIELDS = ("intra_node_gbps", "intra_node_latency_us", "inter_node_gbps", "inter_node_latency_us",
               "devices_per_node")
NVLINK_CLASS = {"nvlink2", "nvlink3", "nvlink4", "nvlink5", "infinity-fabric"}


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_entry_states_its_own_link_figures(name: str) -> None:
    entry = CATALOG[name]
    # Set in the catalog, not left at the model's defaults.
    assert set(LINK_FIELDS) <= entry.model_fields_set, set(LINK_FIELDS) - entry.model_fields_set
    assert entry.intra_node_gbps > 0 and entry.inter_node_gbps > 0
    assert entry.intra_node_latency_us > 0 and entry.inter_node_latency_us > 0
    assert entry.devices_per_node >= 1
    # Inside a node is never slower than the network out of it.
    assert entry.intra_node_gbps >= entry.inter_node_gbps
    assert entry.intra_node_latency_us <= entry.inter_node_latency_us


@pytest.mark.parametrize("name", sorted(n for n, e in CATALOG.items() if e.interconnect in NVLINK_CLASS))
def test_nvlink_parts_are_half_their_bidirectional_figure_and_beat_the_network(name: str) -> None:
    entry = CATALOG[name]
    assert entry.intra_node_gbps == entry.interconnect_gbps / 2
    assert entry.intra_node_gbps > 5 * entry.inter_node_gbps
    assert entry.intra_node_latency_us < entry.inter_node_latency_us


def test_pcie_parts_use_one_direction_of_their_pcie_link() -> None:
    for entry in CATALOG.values():
        if entry.interconnect.startswith("pcie"):
            assert entry.intra_node_gbps == entry.interconnect_gbps / 2, entry.name
    assert CATALOG["h100-pcie"].intra_node_gbps == 64.0
    assert CATALOG["l4"].intra_node_gbps == 32.0
    assert CATALOG["t4"].intra_node_gbps == 16.0


def test_reference_nodes() -> None:
    # DGX H100/H200/B200: one 400 Gb/s ConnectX-7 per GPU; DGX A100: one 200 Gb/s HDR per GPU.
    for name in ("h100-sxm", "h200", "b200"):
        assert (CATALOG[name].inter_node_gbps, CATALOG[name].devices_per_node) == (50.0, 8)
    assert (CATALOG["a100-80gb"].inter_node_gbps, CATALOG["a100-80gb"].devices_per_node) == (25.0, 8)
    # 100 Gbps shared by 8 GPUs (AWS g6.48xlarge).
    assert CATALOG["l4"].inter_node_gbps == pytest.approx(1.5625)
    assert CATALOG["h100-sxm"].intra_node_gbps == 450.0


def test_bare_name_stays_one_device_and_its_only_group_is_local() -> None:
    spec = get_hardware("h100-sxm")
    assert spec.world_size == 1
    assert spec.link_for(1) == Link(450.0, CATALOG["h100-sxm"].intra_node_latency_us, False)


def test_group_of_a_node_stays_on_nvlink_and_strided_groups_cross_nodes() -> None:
    spec = get_hardware("h100-sxm:8x4")
    acc = spec.accelerator
    inside = spec.link_for(8, stride=1)
    assert inside == (acc.intra_node_gbps, acc.intra_node_latency_us, False)
    across = spec.link_for(4, stride=8)
    assert across == (acc.inter_node_gbps, acc.inter_node_latency_us, True)
    gbps, latency_us, crosses = across  # unpacks as a tuple
    assert (gbps, latency_us, crosses) == (50.0, 14.0, True)


@pytest.mark.parametrize(
    ("group_size", "stride", "crosses"),
    [
        (2, 1, False), (4, 2, False), (2, 4, False),  # blocks of 2, 8, 8 ranks inside a node of 8
        (16, 1, True), (2, 8, True), (32, 1, True),  # wider than a node
        (4, 4, True),  # ranks 0, 4, 8, 12: two nodes
        (1, 8, False), (1, 32, False),  # a group of one talks to no one
    ],
)
def test_link_for_tiling(group_size: int, stride: int, crosses: bool) -> None:
    spec = get_hardware("a100-80gb:8x4")
    assert spec.link_for(group_size, stride).crosses_nodes is crosses


def test_a_block_that_straddles_a_node_boundary_crosses() -> None:
    # 6 per node on 2 nodes: groups of 4 consecutive ranks are {0..3}, {4..7}, {8..11}; {4..7} spans both nodes.
    spec = get_hardware("l40s:6x2")
    assert spec.link_for(4).crosses_nodes is True
    assert spec.link_for(4).gbps == CATALOG["l40s"].inter_node_gbps
    assert spec.link_for(3).crosses_nodes is False


def test_one_node_never_crosses() -> None:
    spec = get_hardware("l4:8")
    assert spec.link_for(8) == (32.0, CATALOG["l4"].intra_node_latency_us, False)
    assert spec.link_for(2, stride=4).crosses_nodes is False


@pytest.mark.parametrize(("group_size", "stride"), [(0, 1), (2, 0), (3, 1), (4, 3), (64, 1)])
def test_link_for_rejects_groups_that_do_not_tile_the_ranks(group_size: int, stride: int) -> None:
    with pytest.raises(ValueError):
        get_hardware("h100-sxm:8x4").link_for(group_size, stride)


def test_cpu_entries_describe_gloo() -> None:
    cpu = get_hardware("cpu:1x2")
    assert cpu.accelerator.devices_per_node == 1
    assert cpu.link_for(2) == Link(cpu.accelerator.inter_node_gbps, cpu.accelerator.inter_node_latency_us, True)
    # The probed CPU keeps the catalog CPU's figures.
    local = get_hardware("cpu")
    assert local.accelerator.intra_node_gbps == CATALOG["cpu"].intra_node_gbps


def test_accelerators_built_without_link_figures_get_the_documented_defaults() -> None:
    bare = Accelerator(name="x", vendor="nvidia", memory_bytes=1, peak_tflops={"fp32": 1.0},
                       memory_bandwidth_gbps=1.0, interconnect="pcie4", interconnect_gbps=64.0)
    assert (bare.intra_node_gbps, bare.intra_node_latency_us, bare.inter_node_gbps,
            bare.inter_node_latency_us, bare.devices_per_node) == (32.0, 5.7, 1.25, 14.0, 1)
    assert HardwareSpec(accelerator=bare, devices_per_node=2, nodes=2).link_for(4).crosses_nodes is True
