"""This machine's CPU as a CpuSpec: its identity, and its peak dense FLOP/s derived from what the host says.

peak = cores x clock x FLOP per cycle per core, where
- cores: physical cores among the CPUs sched_getaffinity allows (sysfs topology); hyperthreads
  of one core share its FMA units, so counting them would double the peak without adding any;
- clock: sysfs cpufreq `cpuinfo_max_freq` where present, else /proc/cpuinfo "cpu MHz" (VMs often
  have no cpufreq; their "cpu MHz" is the nominal clock);
- FLOP/cycle: the vector ISA from the /proc/cpuinfo flags, the core's FMA units from
  advisor.hardware.cpuarch, and the bf16 unit (AMX, AVX512-BF16, Arm BF16) from the flags.

Readers take the procfs and sysfs roots as arguments, as advisor.hardware.sysinfo's do.
"""

from __future__ import annotations

import os
from pathlib import Path

from advisor.hardware.cpuarch import ASSUMED_FMA_BITS, Core, arm_core, x86_core
from advisor.hardware.procfs import PROC, SYS, read_optional, read_text
from advisor.hardware.spec import CpuSpec

# Intel: AMX's tile unit does 1024 bf16 FLOP per cycle per core (Intel Architecture Day 2021, "AMX:
# 1024 BF16 ops/cycle"; TDPBF16PS is a 16x32 by 32x16 product, 8192 multiply-adds, over 16 cycles).
AMX_BF16_FLOP_PER_CYCLE = 1024
# VDPBF16PS sums two bf16 products into each fp32 lane at the FMA rate (Intel Optimization Reference
# Manual for Cooper Lake and later; AMD SOG 57647 for Zen 4): twice fp32's FLOP per cycle.
AVX512_BF16_PER_FP32 = 2
# An Arm core with BF16 the table does not know: BFDOT's two products per fp32 lane, at FMLA's rate.
ARM_BF16_ASSUMED_PER_FP32 = 2
# The most an x86 core can issue of each ISA: two FMA pipes of its width (no x86 core has more), or,
# without FMA, one vector multiply and one vector add of its width.
_X86_MAX_FMA_BITS = {"avx512": 1024, "avx2-fma": 512, "avx": 256, "sse": 128}


def cpuinfo_fields(proc: Path = PROC) -> dict[str, str]:
    """The first processor's 'key : value' lines of /proc/cpuinfo (every CPU of one host reports alike)."""
    fields: dict[str, str] = {}
    for line in read_text(proc / "cpuinfo").splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _int(text: str | None) -> int | None:
    """cpuinfo numbers: decimal on x86 ('25'), hex on Arm ('0xd4f'); None if absent or not a number."""
    if text is None:
        return None
    try:
        return int(text, 0) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


def cpu_clock_ghz(cpus: list[int], proc: Path = PROC, sys_root: Path = SYS) -> tuple[float | None, str]:
    """(clock in GHz, 'cpufreq' | 'cpuinfo' | 'none'): the highest of the CPUs' cpuinfo_max_freq, else of
    the /proc/cpuinfo 'cpu MHz' lines."""
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    khz = [read_optional(cpu_dir / f"cpu{cpu}" / "cpufreq" / "cpuinfo_max_freq") for cpu in cpus]
    found = [int(text) for text in khz if text is not None and text.strip().isdigit()]
    if found:
        return round(max(found) / 1e6, 2), "cpufreq"  # kHz -> GHz
    mhz = []
    for line in read_text(proc / "cpuinfo").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz":
            mhz.append(float(value))
    if mhz:
        # Where it is the current clock (bare metal without cpufreq) it moves; 0.1 GHz steps keep the
        # spec, and with it the hardware fingerprint, the same from one probe to the next.
        return round(max(mhz) / 1e3, 1), "cpuinfo"
    return None, "none"


def usable_core_count(cpus: list[int], sys_root: Path = SYS) -> tuple[int, str]:
    """(physical cores among `cpus`, 'topology'), or (len(cpus), 'affinity') where sysfs has no topology."""
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        package, core = read_optional(topo / "physical_package_id"), read_optional(topo / "core_id")
        if package is None or core is None:
            return len(cpus), "affinity"
        cores.add((package.strip(), core.strip()))
    return len(cores), "topology"


def vector_isa(flags: frozenset[str]) -> str:
    """The widest vector multiply-add path in the flags (x86 'flags', Arm 'Features')."""
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2-fma"
    for flag, isa in (("avx", "avx"), ("sse2", "sse"), ("sve", "sve"), ("asimd", "neon")):
        if flag in flags:
            return isa
    return "unknown"


def bf16_unit(flags: frozenset[str]) -> str | None:
    """'amx', 'avx512_bf16' or 'arm_bf16' where the flags show bf16 math; None where bf16 is emulated."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "arm_bf16" if "bf16" in flags else None


def _per_cycle(isa: str, unit: str | None, core: Core | None) -> tuple[int | None, int | None]:
    """(fp32, bf16) FLOP per cycle per core; (None, None) for an ISA this module cannot reason about."""
    if isa == "unknown":
        return None, None
    bits = core.fma_bits if core else ASSUMED_FMA_BITS[isa]
    if isa in _X86_MAX_FMA_BITS:
        bits = min(bits, _X86_MAX_FMA_BITS[isa])  # a VM that hides AVX-512 leaves its cores the AVX2 path
    fp32 = bits // 32 * 2  # fp32 lanes x (multiply + add)
    if unit == "amx":
        return fp32, AMX_BF16_FLOP_PER_CYCLE
    if unit == "avx512_bf16":
        return fp32, fp32 * AVX512_BF16_PER_FP32
    if unit == "arm_bf16":
        return fp32, fp32 * (core.bf16_per_fp32 if core and core.bf16_per_fp32 else ARM_BF16_ASSUMED_PER_FP32)
    return fp32, fp32  # emulated bf16 runs through the fp32 units


def _identity(fields: dict[str, str], flags: frozenset[str]) -> tuple[str, str, int | None, int | None, Core | None]:
    """(model name, vendor, family, model, table core) from the cpuinfo fields."""
    implementer = _int(fields.get("CPU implementer"))
    if implementer is not None:  # Arm: no family; the part number names the core
        part = _int(fields.get("CPU part"))
        core = arm_core(implementer, part)
        vendor = f"arm:{implementer:#x}"
        named = f"Arm {core.name}" if core else f"{vendor} part {fields.get('CPU part', 'unknown')}"
        return fields.get("model name") or named, vendor, None, part, core
    name = fields.get("model name") or "unknown"
    vendor = fields.get("vendor_id") or "unknown"
    family, model = _int(fields.get("cpu family")), _int(fields.get("model"))
    return name, vendor, family, model, x86_core(vendor, family, model, name, flags)


def probe_cpu_spec(proc: Path = PROC, sys_root: Path = SYS, cpus: list[int] | None = None) -> CpuSpec:
    """This machine's CpuSpec; `cpus` defaults to the CPUs this process may run on (sched_getaffinity)."""
    usable = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    fields = cpuinfo_fields(proc)
    flags = frozenset((fields.get("flags") or fields.get("Features") or "").split())
    name, vendor, family, model, core = _identity(fields, flags)
    isa, unit = vector_isa(flags), bf16_unit(flags)
    fp32, bf16 = _per_cycle(isa, unit, core)
    cores, cores_from = usable_core_count(usable, sys_root)
    clock, clock_source = cpu_clock_ghz(usable, proc, sys_root)
    return CpuSpec(model_name=name, vendor=vendor, family=family, model=model,
                   microarchitecture=core.name if core else "unknown", vector_isa=isa, bf16_unit=unit, cores=cores,
                   cores_from=cores_from, clock_ghz=clock, clock_source=clock_source, fp32_flop_per_cycle=fp32,
                   bf16_flop_per_cycle=bf16, per_cycle_from="documented" if core else "assumed")


def cpu_peak_note(cpu: CpuSpec) -> str | None:
    """One line on what the derived peak could not know or had to assume; None when nothing."""
    if cpu.peak_tflops() is None:
        missing = "no clock in cpufreq or /proc/cpuinfo" if cpu.clock_ghz is None else "unknown vector ISA"
        return f"CPU peak FLOP/s: the catalog's nominal figures ({missing})"
    said = []
    if cpu.per_cycle_from == "assumed":
        said.append(f"FMA units of an unknown {cpu.vector_isa} core assumed at the least such cores have")
    if cpu.cores_from == "affinity":
        said.append("no sysfs topology: every usable CPU counted as a core")
    if cpu.clock_source == "cpuinfo":
        said.append(f"clock {cpu.clock_ghz:g} GHz from /proc/cpuinfo (nominal in a VM; boost can run above it)")
    return f"CPU peak FLOP/s: {'; '.join(said)}" if said else None
