"""The local CPU's derived peak (advisor.hardware.cpupeak): /proc/cpuinfo and sysfs text of real CPUs
written under tmp_path, the peaks derived from them, fingerprints that tell CPU models apart, and
this machine's derived peak against a real matmul measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.config import Precision
from advisor.estimate import EstimateOptions, EstimateRequest
from advisor.estimate.roofline import peak_flops
from advisor.hardware import CATALOG, get_hardware, hardware_from_host
from advisor.hardware.cpupeak import cpu_clock_ghz, cpuinfo_fields, probe_cpu_spec, usable_core_count
from advisor.hardware.sysinfo import probe_host
from advisor.store import hardware_fingerprint

X86_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
            "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid tsc_known_freq pni pclmulqdq "
            "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm "
            "3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt "
            "xsavec xgetbv1 xsaves arat")
AVX512 = "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni"

# The first lines of one processor's /proc/cpuinfo block (the rest of a real block changes nothing here).
EPYC_9R14 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17", "model name": "AMD EPYC 9R14",
             "cpu MHz": "2600.000", "flags": f"{X86_BASE} {AVX512} avx512_bf16 clzero"}  # Zen 4 (m7a)
XEON_8375C = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "106",
              "model name": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", "cpu MHz": "2899.964",
              "flags": f"{X86_BASE} {AVX512} avx512_bitalg"}  # Ice Lake-SP (m6i): AVX-512, no bf16 units
XEON_8488C = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "143",
              "model name": "Intel(R) Xeon(R) Platinum 8488C", "cpu MHz": "2400.000",
              "flags": f"{X86_BASE} {AVX512} avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8"}  # Sapphire Rapids
XEON_5118 = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "85",
             "model name": "Intel(R) Xeon(R) Gold 5118 CPU @ 2.30GHz", "cpu MHz": "1000.123",
             "flags": f"{X86_BASE} {AVX512}"}  # Skylake-SP with one AVX-512 FMA unit
EPYC_7R32 = {"vendor_id": "AuthenticAMD", "cpu family": "23", "model": "49", "model name": "AMD EPYC 7R32",
             "cpu MHz": "2799.998", "flags": X86_BASE}  # Zen 2 (c5a): AVX2 + FMA only
GRAVITON3 = {"BogoMIPS": "2100.00", "Features": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
             "cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm "
             "ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng", "CPU implementer": "0x41",
             "CPU architecture": "8", "CPU variant": "0x1", "CPU part": "0xd40", "CPU revision": "1"}  # Neoverse V1
GRAVITON2 = {"BogoMIPS": "243.75", "Features": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
             "cpuid asimdrdm lrcpc dcpop asimddp ssbs", "CPU implementer": "0x41", "CPU architecture": "8",
             "CPU variant": "0x3", "CPU part": "0xd0c", "CPU revision": "1"}  # Neoverse N1
CPUS = [0, 1, 2, 3]


def write_host(root: Path, block: dict[str, str], *, threads_per_core: int = 1, max_khz: int | None = None) -> Path:
    """A procfs + sysfs root for 4 CPUs with `block` in /proc/cpuinfo, SMT siblings sharing core ids."""
    proc, cpu_dir = root / "proc", root / "sys" / "devices" / "system" / "cpu"
    proc.mkdir(parents=True)
    text = "".join(f"processor\t: {cpu}\n" + "".join(f"{k}\t: {v}\n" for k, v in block.items()) + "\n" for cpu in CPUS)
    (proc / "cpuinfo").write_text(text)
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:         8000000 kB\n")
    (cpu_dir).mkdir(parents=True)
    (cpu_dir / "online").write_text("0-3\n")
    for cpu in CPUS:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{cpu // threads_per_core}\n")
        if max_khz is not None:
            (cpu_dir / f"cpu{cpu}" / "cpufreq").mkdir()
            (cpu_dir / f"cpu{cpu}" / "cpufreq" / "cpuinfo_max_freq").write_text(f"{max_khz}\n")
    return root


def spec_of(root: Path):
    return probe_cpu_spec(root / "proc", root / "sys", cpus=CPUS)


@pytest.mark.parametrize(
    ("block", "smt", "khz", "want"),
    [
        # (name, vector ISA, bf16 unit, cores, GHz, clock source, fp32 / bf16 FLOP per cycle per core)
        (EPYC_9R14, 2, None, ("zen4", "avx512", "avx512_bf16", 2, 2.6, "cpuinfo", 32, 64)),
        (XEON_8375C, 2, 3_500_000, ("icelake-sp", "avx512", None, 2, 3.5, "cpufreq", 64, 64)),
        (XEON_8488C, 2, None, ("sapphire-rapids-or-later", "avx512", "amx", 2, 2.4, "cpuinfo", 64, 1024)),
        (XEON_5118, 1, 3_200_000, ("skylake-sp-1fma", "avx512", None, 4, 3.2, "cpufreq", 32, 32)),
        (EPYC_7R32, 2, None, ("zen2", "avx2-fma", None, 2, 2.8, "cpuinfo", 32, 32)),
        (GRAVITON3, 1, 2_600_000, ("neoverse-v1", "sve", "arm_bf16", 4, 2.6, "cpufreq", 32, 128)),
    ],
    ids=["epyc-9r14-zen4-avx512bf16", "xeon-8375c-avx512", "xeon-8488c-amx", "xeon-5118-one-fma", "epyc-7r32-avx2",
         "graviton3-neoverse-v1"],
)
def test_spec_and_peak_of_real_cpus(tmp_path: Path, block, smt, khz, want) -> None:
    spec = spec_of(write_host(tmp_path, block, threads_per_core=smt, max_khz=khz))
    got = (spec.microarchitecture, spec.vector_isa, spec.bf16_unit, spec.cores, spec.clock_ghz, spec.clock_source,
           spec.fp32_flop_per_cycle, spec.bf16_flop_per_cycle)
    assert got == want
    assert spec.per_cycle_from == "documented" and spec.cores_from == "topology"
    _, _, _, cores, ghz, _, fp32, bf16 = want
    assert spec.peak_tflops() == pytest.approx({"fp32": cores * ghz * fp32 / 1e3, "bf16": cores * ghz * bf16 / 1e3})


def test_hyperthreads_share_a_core_and_cpufreq_wins_over_cpuinfo(tmp_path: Path) -> None:
    root = write_host(tmp_path, XEON_8375C, threads_per_core=2, max_khz=3_500_000)
    assert usable_core_count(CPUS, root / "sys") == (2, "topology")
    assert usable_core_count([0, 1], root / "sys") == (1, "topology")  # two siblings: one core's FMA units
    assert cpu_clock_ghz(CPUS, root / "proc", root / "sys") == (3.5, "cpufreq")  # not cpuinfo's 2.9 GHz
    fields = cpuinfo_fields(root / "proc")
    assert fields["processor"] == "0" and fields["model name"].startswith("Intel(R) Xeon(R) Platinum 8375C")
    assert hardware_from_host(probe_host(root / "proc", root / "sys", [0, 1])).note is None  # nothing assumed


def test_amx_names_a_server_core_whatever_model_number_a_hypervisor_reports(tmp_path: Path) -> None:
    # a hypervisor can report model 167 (0xA7, Rocket Lake: one 512-bit FMA unit) with AMX and AVX512-FP16,
    # which only Sapphire Rapids and later server cores have (two units); such a guest's real fp32 matmuls run
    # at 0.41 TFLOP/s on 2 cores at 2.6 GHz, over the one-unit peak of 0.17 even at 1.9x boost
    guest = {**XEON_8488C, "model": "167", "model name": "Intel(R) Xeon(R) Processor"}
    spec = spec_of(write_host(tmp_path, guest))
    assert (spec.microarchitecture, spec.fp32_flop_per_cycle, spec.bf16_flop_per_cycle) == (
        "sapphire-rapids-or-later", 64, 1024)
    rocket_lake = {**guest, "flags": f"{X86_BASE} {AVX512}"}  # the same model number without AMX: the client core
    assert spec_of(write_host(tmp_path / "client", rocket_lake)).fp32_flop_per_cycle == 32


def test_a_vm_that_hides_avx512_leaves_the_avx2_path(tmp_path: Path) -> None:
    hidden = {**XEON_8488C, "flags": X86_BASE}  # Sapphire Rapids cores, AVX-512 and AMX masked
    spec = spec_of(write_host(tmp_path, hidden))
    assert (spec.vector_isa, spec.bf16_unit, spec.fp32_flop_per_cycle, spec.bf16_flop_per_cycle) == (
        "avx2-fma", None, 32, 32)


def test_unknown_core_uses_the_least_its_isa_has(tmp_path: Path) -> None:
    unknown = {**EPYC_7R32, "vendor_id": "HygonGenuine", "cpu family": "24", "model name": "Hygon C86 7285"}
    root = write_host(tmp_path, unknown)
    spec = spec_of(root)
    assert (spec.microarchitecture, spec.per_cycle_from, spec.fp32_flop_per_cycle) == ("unknown", "assumed", 16)
    hw = hardware_from_host(probe_host(root / "proc", root / "sys", CPUS))
    assert hw.note is not None and "assumed" in hw.note and "2.8 GHz from /proc/cpuinfo" in hw.note


def test_no_clock_falls_back_to_the_catalog_and_says_so(tmp_path: Path) -> None:
    """Graviton2 in a virtual machine: no cpufreq, and Arm's /proc/cpuinfo has no 'cpu MHz'."""
    root = write_host(tmp_path, GRAVITON2)
    spec = spec_of(root)
    assert (spec.model_name, spec.vendor, spec.model, spec.microarchitecture) == ("Arm neoverse-n1", "arm:0x41", 0xD0C,
                                                                                  "neoverse-n1")
    assert (spec.vector_isa, spec.bf16_unit, spec.clock_source, spec.fp32_flop_per_cycle) == ("neon", None, "none", 16)
    assert spec.peak_tflops() is None
    hw = hardware_from_host(probe_host(root / "proc", root / "sys", CPUS))
    assert hw.accelerator.peak_tflops == CATALOG["cpu"].peak_tflops and hw.accelerator.cpu is not None
    assert hw.note == "CPU peak FLOP/s: the catalog's nominal figures (no clock in cpufreq or /proc/cpuinfo)"


def test_fingerprint_tells_cpu_models_apart(tmp_path: Path) -> None:
    zen4 = write_host(tmp_path / "a", EPYC_9R14)
    other = write_host(tmp_path / "b", {**EPYC_9R14, "model name": "AMD EPYC 9654", "model": "17"})
    milan = write_host(tmp_path / "c", {**EPYC_9R14, "model": "1", "flags": X86_BASE})  # Zen 3, same clock
    specs = [hardware_from_host(probe_host(r / "proc", r / "sys", CPUS)) for r in (zen4, other, milan, zen4)]
    # Same cores, memory and clock on every one: only the CPU itself differs.
    assert len({(s.cpu_cores, s.host_memory_bytes, s.accelerator.cpu.clock_ghz) for s in specs}) == 1
    prints = [hardware_fingerprint(s) for s in specs]
    assert len(set(prints[:3])) == 3 and prints[3] == prints[0]


def test_catalog_fingerprints_did_not_move() -> None:
    """Fingerprints stored before `accelerator.cpu` existed must still match (values from before it)."""
    assert hardware_fingerprint(get_hardware("h100-sxm")) == (
        "bddbd60673d19e57b548139bab29f6261a913ce271fe9510849ed95fb46bba8c")
    assert hardware_fingerprint(get_hardware("cpu:4")) == (
        "404bc657f33e8e03151bb2fd2c6a746ec82d772a6b51faa0539eebbec240c58d")
    assert get_hardware("cpu:4").accelerator == CATALOG["cpu"]  # the generic CPU stays generic


def test_this_machine_derives_a_peak_at_least_its_measured_matmuls() -> None:
    """The real local probe against probes' real matmul measurement (short: ~1 s per dtype)."""
    from probes.bench_kernels import bench_matmul

    hw = get_hardware("cpu")
    cpu, peaks = hw.accelerator.cpu, hw.accelerator.cpu.peak_tflops()
    if peaks is None:
        pytest.skip(f"this host's CPU peak cannot be derived: {hw.note}")
    assert peaks["fp32"] > 0 and peaks["bf16"] >= peaks["fp32"]
    assert hw.accelerator.peak_tflops == peaks
    assert peak_flops(hw, Precision.bf16) == pytest.approx(peaks["bf16"] * 1e12)  # what the roofline divides by
    # cpufreq's cpuinfo_max_freq is the top boost clock: nothing runs above that peak. /proc/cpuinfo's
    # "cpu MHz" under a hypervisor is the nominal clock, and boost runs above it, by up to 1.9x on current server
    # parts (Intel ARK, Xeon Platinum 8480+: 2.0 GHz base, 3.8 GHz max turbo).
    boost = 1.0 if cpu.clock_source == "cpufreq" else 1.9
    for dtype in ("fp32", "bf16") if cpu.bf16_unit else ("fp32",):
        measured = bench_matmul("cpu", dtype, 1.0).tflops
        assert 0 < measured <= peaks[dtype] * boost, (dtype, measured, peaks[dtype], cpu)


def test_fp16_on_a_cpu_has_no_roofline_rather_than_fp32s_peak() -> None:
    """A CPU's fp16 products run far under its fp32 peak (no fp16 unit): the real estimate says it has no step
    time for fp16 instead of crediting fp32's peak, and still times bf16; a GPU missing a dtype's figure still
    takes fp32's (a T4 lists no bf16 peak)."""
    from advisor import estimate_memory

    for target in ("cpu", "local"):
        with pytest.raises(ValueError, match="no fp16 peak"):
            peak_flops(get_hardware(target), Precision.fp16)
    assert peak_flops(get_hardware("t4"), Precision.bf16) == pytest.approx(CATALOG["t4"].peak_tflops["fp32"] * 1e12)
    half = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=8, precision="fp16"),
                           EstimateOptions(calibrate=False, measured=False))
    assert half.predicted_step_s is None and half.predicted_samples_per_s is None
    assert any(n.startswith("no roofline:") and "no fp16 peak" in n for n in half.notes), half.notes
    assert half.total_bytes > 0  # the memory estimate itself is unchanged
    bf16 = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=8, precision="bf16"),
                           EstimateOptions(calibrate=False, measured=False))
    assert bf16.predicted_step_s is not None and bf16.predicted_step_s > 0
