"""Stable hashes that key stored results: a configuration, a hardware target, the software stack."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from advisor.hardware.spec import HardwareSpec
    from advisor.trial import TrainingConfig


def _digest(obj: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no spaces), so equal content hashes equally anywhere."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def config_hash(config: "TrainingConfig") -> str:
    """Every knob, defaults included: two configs hash equally exactly when they set the same knobs."""
    knobs = config.model_dump(mode="json")
    # checkpointing was a boolean when configurations were first stored: none and full hash as False and True did,
    # so those hashes stay what they were
    knobs["checkpointing"] = config.checkpointing.legacy
    # the parallel-layout knobs and lora_r came after configurations were first stored: left out while at their
    # defaults (every configuration without tp, pp or a LoRA rank), those hashes stay what they were
    for key, default in LATER_DEFAULTS.items():
        if knobs.get(key) == default:
            knobs.pop(key, None)
    return _digest(knobs)


LATER_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1, "pp_schedule": "1f1b", "microbatches": None,
                  "micro_batch_size": None, "virtual_stages": 1, "stage_layers": None, "sequence_parallel": True,
                  "lora_r": None}


def hardware_fingerprint(hw: "HardwareSpec") -> str:
    """What results depend on: the accelerator (a probed CPU's model and ISA included) and the shape of
    the target. Probe notes and the is_local flag are left out, so a probed machine and its catalog
    entry with the same figures match."""
    spec = hw.model_dump(mode="json", exclude={"note", "is_local"})
    # `accelerator.cpu` came after fingerprints were first stored: left out while unset (every catalog
    # entry, every GPU), those fingerprints stay what they were.
    if spec["accelerator"].get("cpu") is None:
        del spec["accelerator"]["cpu"]
    # so did a GPU's multiprocessor figures, which the GPU's name and figures already pin down: left out, so
    # that results stored before them still match
    for key in ("multiprocessors", "max_threads_per_multiprocessor", "intra_node_gbps", "intra_node_latency_us",
                "inter_node_gbps", "inter_node_latency_us", "devices_per_node"):
        spec["accelerator"].pop(key, None)
    return _digest(spec)


def software_versions() -> dict[str, str | None]:
    """torch, Python and CUDA versions (CUDA None on a CPU build of torch), as torch.__version__ and
    torch.version.cuda give them."""
    torch = _torch_version()
    return {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.cuda}


def _torch_version() -> Any:
    """torch's `version` module. Read from its file where torch is not imported yet: importing torch costs a
    second, and a process that only keys results by it (the tuner's driver) need not."""
    import importlib.util
    import sys

    if "torch" in sys.modules:
        return sys.modules["torch"].version
    spec = importlib.util.find_spec("torch")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / "version.py" if spec else None
    if path is None or not path.is_file():
        import torch  # an unusual installation: let torch say

        return torch.version
    loaded = importlib.util.spec_from_file_location("_advisor_torch_version", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def software_fingerprint(versions: dict[str, str | None] | None = None) -> str:
    """A hash of `software_versions()`; a measured figure is reused only under the same one."""
    return _digest(versions if versions is not None else software_versions())
