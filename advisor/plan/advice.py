"""What would fit when no plan does: the fewest devices or nodes of the same type, and which knob held by
`--fix` stands in the way. Each answer is a search at the least memory of every mesh (space.py's frugal
families, full checkpointing, the optimizer offloaded unless held), not a rule of thumb."""

from __future__ import annotations

from advisor.estimate.parallel_tuned import Tuning
from advisor.hardware.spec import HardwareSpec
from advisor.plan.knobs import FixedKnobs, Offload, PlanConfig
from advisor.plan.memory import device_memory, peak_ranks
from advisor.plan.model import MAX_NODES
from advisor.plan.space import CHECKPOINTING, Rejections, families
from advisor.workload import DecoderArch

NODE_DEVICES = 8  # devices per node tried where one node holds fewer (HGX/DGX nodes hold 8)


def what_would_fit(arch: DecoderArch, hw: HardwareSpec, global_batch: int, fixed: FixedKnobs,
                   usable: int, tuning: Tuning | None = None) -> list[str]:
    """One line per change that makes a plan fit on `hw`'s device type (none: nothing within MAX_NODES nodes);
    `tuning`: a fine-tune, planned data parallel only."""
    out = []
    bigger = fewest_devices(arch, hw, global_batch, fixed, usable, tuning)
    if bigger is not None:
        target, config = bigger
        out.append(f"{target.world_size} devices fit ({target.accelerator.name}:{target.devices_per_node}x"
                   f"{target.nodes}), e.g. {_describe(config)}")
    for knob, value in fixed.given().items():
        config = fitting(arch, hw, global_batch, fixed.without(knob), usable, tuning)
        if config is not None:
            out.append(f"without holding {knob}={value}, it fits on {hw.world_size} devices: {_describe(config)}")
    if not out:
        out.append(f"nothing fits on up to {MAX_NODES} nodes of {hw.devices_per_node} {hw.accelerator.name}, even "
                   "with full checkpointing, micro-batches of 1 and the optimizer offloaded")
    return out


def fewest_devices(arch: DecoderArch, hw: HardwareSpec, global_batch: int, fixed: FixedKnobs,
                   usable: int, tuning: Tuning | None = None) -> tuple[HardwareSpec, PlanConfig] | None:
    """The smallest target of `hw`'s type larger than `hw` on which a configuration fits, and that configuration:
    more devices in the one node (up to NODE_DEVICES) first, then more nodes. The node count doubles until one
    fits, then the counts in between are tried upward: a fit at n nodes does not imply one at n + 1 (the global
    batch and the layers must split over the mesh)."""
    if hw.nodes == 1:
        for per_node in range(hw.devices_per_node + 1, NODE_DEVICES + 1):
            target = hw.model_copy(update={"devices_per_node": per_node})
            config = fitting(arch, target, global_batch, fixed, usable, tuning)
            if config is not None:
                return target, config
    per_node = max(hw.devices_per_node, NODE_DEVICES) if hw.nodes == 1 else hw.devices_per_node
    low, high = hw.nodes, hw.nodes * 2
    while high <= MAX_NODES:
        target = hw.model_copy(update={"devices_per_node": per_node, "nodes": high})
        config = fitting(arch, target, global_batch, fixed, usable, tuning)
        if config is not None:
            for nodes in range(low + 1, high):
                smaller = target.model_copy(update={"nodes": nodes})
                found = fitting(arch, smaller, global_batch, fixed, usable, tuning)
                if found is not None:
                    return smaller, found
            return target, config
        low, high = high, high * 2
    return None


def fitting(arch: DecoderArch, hw: HardwareSpec, global_batch: int, fixed: FixedKnobs,
            usable: int, tuning: Tuning | None = None) -> PlanConfig | None:
    """A configuration at the least memory of some mesh that fits on `hw`, or None."""
    mode = fixed.checkpointing or CHECKPOINTING[-1]
    fams = list(families(arch, hw, global_batch, fixed, Rejections(), frugal=True, dp_only=tuning is not None))
    for offload in [fixed.offload] if fixed.offload else [Offload.none, Offload.optimizer]:
        for fam in fams:
            config = fam.config(fam.sizes[0], mode, offload)
            if device_memory(arch, hw, config, usable, peak_ranks(config.layout()), tuning).fits:
                return config
    return None


def _describe(config: PlanConfig) -> str:
    parts = [config.label(), f"micro-batch {config.micro_batch_size}", f"{config.checkpointing.value} checkpointing"]
    if config.offload != Offload.none:
        parts.append(f"{config.offload.value} offloaded")
    return ", ".join(parts)
