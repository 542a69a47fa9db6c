"""Per-core vector throughput of CPU microarchitectures: what the /proc/cpuinfo flags cannot say.

The flags name the vector ISA (AVX-512, AVX2+FMA, NEON, SVE) but not how many FMA units a core
has. Each `Core` gives `fma_bits`: the fp32 multiply-add datapath a core retires per cycle (vector
width x FMA instructions per cycle, in bits), so fp32 FLOP/cycle = fma_bits / 32 x 2 (multiply
and add). Every figure names the vendor document it comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Core:
    """One core family: its name in the spec, its FMA datapath, and its bf16 rate where documented."""

    name: str
    fma_bits: int  # fp32 multiply-add bits retired per cycle per core
    bf16_per_fp32: int | None = None  # bf16 FLOP per fp32 FLOP of the core's bf16 matrix instruction


# --- Intel (vendor_id GenuineIntel, cpu family 6); model numbers from the Intel SDM vol. 4, table 2-1.
# Intel 64 and IA-32 Architectures Optimization Reference Manual (248966): Haswell has two 256-bit FMA
# units (ports 0 and 1), kept through Skylake client and its Kaby/Coffee/Comet Lake refreshes.
_HASWELL_CLIENT = Core("haswell-to-comet-lake", 512)
# Same manual, Skylake Server: a 512-bit FMA on fused ports 0+1 plus one on port 5; "some processors"
# lack the port-5 unit (Intel ARK "# of AVX-512 FMA Units": 1 on Bronze, Silver, most Gold 5xxx).
_SKYLAKE_SP = Core("skylake-sp", 1024)
_SKYLAKE_SP_ONE_FMA = Core("skylake-sp-1fma", 512)
# Same manual: Ice Lake, Tiger Lake and Rocket Lake clients have the fused-port 512-bit FMA only.
_ICELAKE_CLIENT = Core("icelake-client", 512)
# Same manual: Ice Lake server and Golden Cove server cores (Sapphire/Emerald Rapids) and Redwood
# Cove (Granite Rapids) have two 512-bit FMA units.
_ICELAKE_SP = Core("icelake-sp", 1024)
_SAPPHIRE_RAPIDS = Core("sapphire-rapids-or-later", 1024)

_INTEL_FAMILY6: dict[int, Core] = {
    **{m: _HASWELL_CLIENT for m in (0x3C, 0x3F, 0x45, 0x46, 0x3D, 0x47, 0x4F, 0x56, 0x4E, 0x5E, 0x8E, 0x9E,
                                    0xA5, 0xA6)},
    0x55: _SKYLAKE_SP,  # Skylake-SP, Cascade Lake, Cooper Lake
    **{m: _ICELAKE_SP for m in (0x6A, 0x6C)},
    **{m: _ICELAKE_CLIENT for m in (0x7D, 0x7E, 0x8C, 0x8D, 0xA7)},
    **{m: _SAPPHIRE_RAPIDS for m in (0x8F, 0xCF, 0xAD, 0xAE)},
}
# Model 0x55 parts with one AVX-512 FMA unit (Intel ARK); Gold 5122/5222 have two.
_ONE_FMA_SKYLAKE_SP = re.compile(r"\b(bronze|silver)\b|\bgold 5(?!122|222)\d{3}|\bi7-78[02]0x\b")

# --- AMD (vendor_id AuthenticAMD), by cpu family.
# Software Optimization Guide for AMD Family 17h Processors (55723): four 128-bit FP pipes, FMA on
# two of them; a 256-bit op runs as two 128-bit halves (Zen, Zen+: models below 30h).
_ZEN = Core("zen", 256)
# Software Optimization Guide for AMD Family 17h Models 30h and Greater (56305): 256-bit datapaths
# with two FMA pipes (Zen 2).
_ZEN2 = Core("zen2", 512)
# Software Optimization Guide for AMD Family 19h Processors (56665, Zen 3) and for the EPYC 9004
# Series (57647, Zen 4): two 256-bit FMA pipes; Zen 4 runs a 512-bit op as two 256-bit halves, and
# issues VDPBF16PS on the FMA pipes at FMA's rate.
_ZEN3 = Core("zen3", 512)
_ZEN4 = Core("zen4", 512)
# Software Optimization Guide for AMD Family 1Ah Processors (58455, Zen 5): a full 512-bit datapath
# with two FMA pipes; the mobile parts (models 20h-2Fh, 60h-7Fh) keep 256-bit datapaths.
_ZEN5 = Core("zen5", 1024)
_ZEN5_MOBILE = Core("zen5-mobile", 512)

# --- Arm (CPU implementer 0x41), by CPU part. The figures are the Arm Neoverse Software Optimization
# Guides' throughputs as LLVM encodes them (llvm/lib/Target/AArch64/AArch64SchedNeoverse*.td): FMLA
# and BFMMLA issue on the same V pipes at one per pipe per cycle, and a 128-bit BFMMLA does 32 FLOP
# (a 2x4 by 4x2 bf16 product) to FMLA's 8, so bf16 runs at 4x fp32.
_ARM_PARTS: dict[int, Core] = {
    0xD0C: Core("neoverse-n1", 256),  # N1 SOG: two 128-bit FP/ASIMD pipes; no BF16
    0xD49: Core("neoverse-n2", 256, bf16_per_fp32=4),  # N2 SOG: two 128-bit V pipes
    0xD40: Core("neoverse-v1", 512, bf16_per_fp32=4),  # V1 SOG: four 128-bit V pipes (two 256-bit for SVE)
    0xD4F: Core("neoverse-v2", 512, bf16_per_fp32=4),  # V2 SOG (PJDOC-466751330-593177): four 128-bit V pipes
}
ARM_IMPLEMENTER = 0x41

# Where the core is not in the tables: the least FMA datapath any core with the ISA has, so the
# peak is not overstated by a guess (one 512-bit FMA for AVX-512, as Ice Lake client and Zen 4;
# 256 bits for AVX2, as Zen; two 128-bit pipes for SVE, as Neoverse N2; one 128-bit for NEON/SSE).
# 'avx' and 'sse' have no FMA: a vector multiply and a vector add per cycle count as one FMA.
ASSUMED_FMA_BITS = {"avx512": 512, "avx2-fma": 256, "avx": 256, "sse": 128, "sve": 256, "neon": 128}


def x86_core(vendor: str, family: int | None, model: int | None, model_name: str, flags: frozenset[str]) -> Core | None:
    """The table's x86 core for vendor_id/family/model (and the name or flags where those decide), else None."""
    if family is None or model is None:
        return None
    if vendor == "GenuineIntel" and family == 6:
        if "amx_tile" in flags:
            # AMX exists only on Xeon server cores from Sapphire Rapids on (Intel SDM vol. 1, ch. 18), all
            # with two 512-bit FMA units. A hypervisor may report another model number, e.g. 0xA7 (Rocket
            # Lake, a client core with one) beside amx_tile and avx512_fp16.
            return _SAPPHIRE_RAPIDS
        core = _INTEL_FAMILY6.get(model)
        if core is _SKYLAKE_SP and _ONE_FMA_SKYLAKE_SP.search(model_name.lower()):
            return _SKYLAKE_SP_ONE_FMA
        return core
    if vendor != "AuthenticAMD":
        return None
    if family == 0x17:
        return _ZEN if model < 0x30 else _ZEN2
    if family == 0x19:
        return _ZEN4 if "avx512f" in flags else _ZEN3
    if family == 0x1A:
        return _ZEN5_MOBILE if 0x20 <= model <= 0x2F or 0x60 <= model <= 0x7F else _ZEN5
    return None


def arm_core(implementer: int | None, part: int | None) -> Core | None:
    """The table's Arm core for 'CPU implementer' and 'CPU part', else None."""
    return _ARM_PARTS.get(part) if implementer == ARM_IMPLEMENTER and part is not None else None
