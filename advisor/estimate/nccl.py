"""NCCL's buffers on a CUDA rank: device memory each communicator allocates outside PyTorch's caching allocator,
counted beside the CUDA context. A model of NCCL's defaults (sizes from NCCL's src/include/device.h and
src/init.cc), not a measurement: NCCL picks its channel counts from the topology it finds, and reports of one
communicator's memory (544 MB for 2 and 688 MB for 4 A100s over NVLink, NVIDIA/nccl#964) sit within 2x of it."""

from __future__ import annotations

from advisor.hardware.spec import HardwareSpec

MIB = 1 << 20
SIMPLE = 1 << 22  # DEFAULT_BUFFSIZE: the Simple protocol's buffer per connection and channel
LL = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x a 16-byte FIFO line
LL128 = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 bytes
GRANULE = 2 * MIB  # cuMem rounds each allocation to the device's granularity (NVIDIA/nccl#1685: 10 MiB buffers)


def _round(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


# one channel of a ring: the receive side's LL and LL128 buffers, the Simple buffer (read from the sender over
# NVLink), and the connection's head, tail and FIFO (one granule)
RING_CHANNEL = _round(LL + LL128) + _round(SIMPLE) + GRANULE
# one channel of a point-to-point peer: Simple only, in chunks of NCCL_P2P_NVL_CHUNKSIZE (512 KiB) x NCCL_STEPS
P2P_CHANNEL = _round((1 << 19) * 8) + GRANULE


def channels(hw: HardwareSpec, crosses_nodes: bool) -> int:
    """Collective channels NCCL opens for a group: 32 on NVSwitch-class links (>= 300 GB/s a direction; NCCL
    doubles the 16 its search finds on such nodes), 16 on slower NVLink or xGMI, 4 on PCIe; across nodes two per
    device's NIC, at most 32."""
    if crosses_nodes:
        return min(32, 2 * hw.devices_per_node)
    gbps = hw.accelerator.intra_node_gbps or 0.0
    return 32 if gbps >= 300 else 16 if gbps >= 100 else 4


def collective_bytes(hw: HardwareSpec, group_size: int, stride: int = 1, *, all_reduce: bool = False) -> int:
    """One rank's buffers for the ring collectives of a group of `group_size` ranks `stride` apart (0 for a group
    of one); `all_reduce`: the group also all-reduces, for which NCCL connects a tree beside the ring (bytes)."""
    if group_size < 2 or hw.device_type != "cuda":
        return 0
    link = hw.link_for(group_size, stride)
    return channels(hw, link.crosses_nodes) * RING_CHANNEL * (2 if all_reduce else 1)


def p2p_bytes(hw: HardwareSpec, group_size: int, stride: int, peers: int) -> int:
    """One rank's buffers for point-to-point sends to and from `peers` ranks of a pipeline group (bytes): each peer
    gets a quarter of the group's collective channels on NVLink (at least 2), two across nodes."""
    if group_size < 2 or peers < 1 or hw.device_type != "cuda":
        return 0
    link = hw.link_for(group_size, stride)
    per_peer = 2 if link.crosses_nodes else max(2, channels(hw, False) // 4)
    return peers * per_peer * P2P_CHANNEL


def layout_bytes(hw: HardwareSpec, layout, pp_rank: int) -> int:
    """The NCCL buffers of one rank of pipeline rank `pp_rank` of `layout` (advisor/parallel/layout.py): a
    communicator per mesh dimension it spans (ranks ordered pp, dp, cp, tp, tp innermost), the pipeline's
    neighbours point to point (bytes). DDP and zero1 all-reduce their gradients; tensor parallel without sequence
    parallel all-reduces its activations."""
    from advisor.config import Strategy

    t, c = layout.tp, layout.cp
    total = collective_bytes(hw, t, 1, all_reduce=not layout.sequence_parallel)
    total += collective_bytes(hw, c, t)
    reduce = layout.strategy in (Strategy.ddp, Strategy.zero1)
    if layout.dp_replicate > 1:
        total += collective_bytes(hw, layout.dp_shard * c, t)
        total += collective_bytes(hw, layout.dp_replicate, t * c * layout.dp_shard, all_reduce=True)
    else:
        total += collective_bytes(hw, layout.grad_ranks, t, all_reduce=reduce)
    if layout.pp > 1:
        looped = layout.virtual_stages > 1  # the last rank's stages send back to the first
        peers = 2 if looped or 0 < pp_rank < layout.pp - 1 else 1
        total += p2p_bytes(hw, layout.pp, t * c * layout.dp, peers)
    return total


def data_parallel_bytes(hw: HardwareSpec, strategy) -> int:
    """The NCCL buffers of one device of a data-parallel strategy over every device of `hw` (bytes): DDP and zero1
    all-reduce the gradients (zero1 also broadcasts the parameters), zero2 and zero3 reduce-scatter and
    all-gather."""
    from advisor.config import Strategy

    if strategy == Strategy.single:
        return 0
    return collective_bytes(hw, hw.world_size, 1, all_reduce=strategy in (Strategy.ddp, Strategy.zero1))
