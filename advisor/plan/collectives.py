"""Seconds of the collectives a step issues, by the alpha-beta model (Hockney 1994; the ring costs of Thakur,
Rabenseifner and Gropp 2005, as NCCL's ring runs them): each of a ring's steps pays the link's latency, and
the payload crosses the slowest link of the group, which is the network's once the group spans nodes.

Payloads are as advisor/parallel/comm.py counts them: the all-reduced buffer, the gathered output, the input a
reduce-scatter reduces, a send's tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.hardware.spec import HardwareSpec

# NCCL's large-message bus bandwidth as a share of the link's: nccl-tests' busbw reaches 80-90% of NVLink's and
# of a NIC's line rate on DGX systems; the lower end, as a planner should be
COMM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Group:
    """A process group of `size` ranks whose consecutive members are `stride` apart in the global rank order
    (ranks fill a node first), with the bandwidth (bytes/s, one direction) that bounds it and the mean latency
    (s) of one of its ring's steps."""

    size: int
    stride: int
    bandwidth: float
    latency: float
    crosses_nodes: bool


def group(hw: HardwareSpec, size: int, stride: int, rings: bool = True) -> Group:
    """The group of `size` ranks `stride` apart on `hw`, priced by its slowest link. `rings`: its collectives run
    rings over every NIC of a node (else point-to-point, each rank over its own)."""
    gbps, latency_us, crosses = hw.link_for(size, stride)
    local = min(size, max(1, hw.devices_per_node // stride)) if crosses else size  # members per node
    # NCCL runs one ring per NIC: the group's members in a node pool their NICs, up to the node's own links
    if crosses and rings:
        gbps = min(gbps * local, hw.accelerator.intra_node_gbps)
    # of a ring's size - 1 steps, nodes - 1 cross the network and the rest stay on the node's links
    nodes = size // local
    steps = max(size - 1, 1)
    latency = ((nodes - 1) * latency_us + (size - nodes) * hw.accelerator.intra_node_latency_us) / steps \
        if crosses else latency_us
    return Group(size=size, stride=stride, bandwidth=gbps * 1e9 * COMM_EFFICIENCY, latency=latency * 1e-6,
                 crosses_nodes=crosses)


def seconds(kind: str, payload: float, g: Group, calls: int = 1) -> float:
    """Seconds of `calls` collectives of `kind` moving `payload` bytes in all (as comm.py counts them) on `g`."""
    n = g.size
    if n == 1 or payload == 0:
        return 0.0
    if kind == "all_reduce":  # reduce-scatter then all-gather around the ring; NCCL's double binary tree where
        # its 2 log2(n) steps cost less latency than the ring's 2 (n - 1)
        steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
        return calls * steps * g.latency + 2 * (n - 1) * payload / n / g.bandwidth
    if kind in ("all_gather", "reduce_scatter", "broadcast"):  # a broadcast of each member's partition in turn
        return (n - 1) * (calls * g.latency + payload / n / g.bandwidth)
    if kind in ("send", "recv", "all_to_all"):
        return calls * g.latency + payload / g.bandwidth
    raise ValueError(f"no cost model for collective kind {kind!r}")
