"""The hardware catalog: vendor peak figures for the accelerators the advisor can plan for.

Conventions, the same for every entry:

- `memory_bytes`: vendors write "80GB" for HBM/GDDR capacity in the JEDEC sense, where a GB of
  DRAM is 2**30 bytes (the stacks and chips are binary-sized), so "80GB" is stored as 80 GiB.
  The runtime reports a little less (ECC, driver reservations): an H100 SXM 80GB reports
  85,520,809,984 bytes (79.65 GiB) from `torch.cuda.get_device_properties().total_memory`,
  against 85,899,345,920 (80 GiB) here. `get_hardware("local")` substitutes the probed figure.
- `peak_tflops`: dense peaks (no 2:4 structured sparsity). NVIDIA datasheets print tensor-core
  figures with sparsity (marked "*"); the dense figure is half of it. `fp32` is the non-tensor
  (CUDA core / vector) peak, the one plain fp32 matmuls get with TF32 off. `fp16` is the
  tensor-core peak with fp32 accumulate, which is what autocast matmuls use; GeForce cards run
  fp32 accumulate at half their fp16-accumulate rate. A dtype the device has no fast path for
  is left out and its `supports_*` flag is False.
- `memory_bandwidth_gbps`, `interconnect_gbps`: GB/s = 1e9 bytes/s as vendors print them;
  interconnect figures are per device, bidirectional (both directions summed).
- Communication figures (alpha-beta: time = latency + bytes / bandwidth) are one-way, per device:
  `intra_node_gbps` is half the bidirectional NVLink/xGMI figure, or one direction of the PCIe x16
  link (a 2-card NVLink bridge is not assumed: groups past two cards still cross PCIe);
  `inter_node_gbps` is the reference node's scale-out NICs over its `devices_per_node` devices.
  Latencies are NCCL's per-step hwLat for the ring algorithm, Simple protocol (the one large,
  bandwidth-bound transfers use), from NCCL's tuning model (see NCCL_* below).
"""

from __future__ import annotations

import re

from advisor.hardware.spec import Accelerator

GiB = 2**30  # bytes; see the module docstring for why vendor "GB" capacities are binary

# Interconnect figures shared by many entries (per device, bidirectional GB/s).
PCIE3_X16_GBPS = 32.0  # PCIe Gen3 x16, as printed in the T4 datasheet
PCIE4_X16_GBPS = 64.0  # PCIe Gen4 x16, as printed in the A100/A10/L4/L40S datasheets
PCIE5_X16_GBPS = 128.0  # PCIe Gen5 x16, as printed in the H100/H200 datasheets

# One direction of those links (GB/s): half the bidirectional figures above, as the datasheets print them.
PCIE3_X16_ONE_WAY_GBPS = PCIE3_X16_GBPS / 2
PCIE4_X16_ONE_WAY_GBPS = PCIE4_X16_GBPS / 2
PCIE5_X16_ONE_WAY_GBPS = PCIE5_X16_GBPS / 2

# Per-step latencies (us) of NCCL's tuning model: NVIDIA/nccl src/graph/tuning.cc (NCCL 2.30.7),
# ncclTunerConstantsDefaults.hwLatencies, Ring row, Simple protocol. NCCL prices a ring collective as
# baseLatency + nsteps x hwLatency + bytes / busBw; its model does not tell NVLink generations, nor InfiniBand
# from RoCE (the IB and socket transports report no latency of their own: net_ib/init.cc and
# net_socket.cc set props->latency = 0). Its per-collective base latency (Ring/Simple) is 8.4 us.
NCCL_NVLINK_STEP_US = 3.4
NCCL_PCI_STEP_US = 5.7
NCCL_NET_STEP_US = 14.0

# Reference-node networks, per GPU: the node's scale-out Gb/s over its GPUs, / 8 bits for GB/s.
# DGX H100/H200 and DGX B200: eight single-port ConnectX-7, up to 400 Gb/s each, one per GPU (NVIDIA DGX
# BasePOD reference architecture, "Core Components"; DGX B200 User Guide, "Hardware Overview").
DGX_CX7_GBPS = 400 / 8
# DGX A100: eight single-port ConnectX-6 VPI, 200 Gb/s HDR InfiniBand each, one per GPU (NVIDIA DGX A100
# User Guide DU-09821-001, "Component Specifications").
DGX_A100_HDR_GBPS = 200 / 8
# AWS g5.48xlarge (8 A10G), g6.48xlarge (8 L4), g4dn.metal (8 T4): 100 Gbps per instance (AWS Batch User
# Guide "GPU jobs" and the EC2 G4dn/G6 instance tables): 12.5 Gb/s per GPU.
AWS_100G_8GPU_GBPS = 100 / 8 / 8


# Multiprocessors per device, and the threads each holds (by compute capability: CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability": 2048 on 7.0, 8.0, 9.0 and 10.0; 1024 on 7.5;
# 1536 on 8.6 and 8.9). torch's kernels size their grids from both, and its reductions their scratch
# (advisor/estimate/cuda_reduce.py). SM counts: the architecture whitepapers (A100 2020: 108; H100 2022,
# table 3: SXM5 132, PCIe 114; H200 is the H100 SXM5's GH100 configuration, and an H200's allocator events
# here match 132), NVIDIA's Blackwell brief (B200: 148), the Ada whitepaper (L4: 58; L40S: 142, its 18,176
# CUDA cores / 128; RTX 4090: 128), the GA102 whitepaper (RTX 3090: 82), the Turing and Volta whitepapers
# (T4: 40; V100: 80). The A10G's 80 is what CUDA's deviceQuery reports on EC2 G5 (the A10 has 72).
_MULTIPROCESSORS: dict[str, tuple[int, int]] = {
    "a100-40gb": (108, 2048), "a100-80gb": (108, 2048), "h100-sxm": (132, 2048), "h100-pcie": (114, 2048),
    "h200": (132, 2048), "b200": (148, 2048), "l4": (58, 1536), "l40s": (142, 1536), "a10g": (80, 1536),
    "t4": (40, 1024), "v100": (80, 2048), "v100-16gb": (80, 2048), "rtx-4090": (128, 1536),
    "rtx-3090": (82, 1536), "tiny": (16, 2048),
}


def _nvidia(name: str, **fields: object) -> Accelerator:
    sms, threads = _MULTIPROCESSORS[name]
    return Accelerator(name=name, vendor="nvidia", multiprocessors=sms, max_threads_per_multiprocessor=threads,
                       **fields)


_ENTRIES: list[Accelerator] = [
    # NVIDIA A100 Tensor Core GPU datasheet (2021, r4), SXM4 column: FP32 19.5 TF;
    # TF32 156 | 312* TF; BF16 312 | 624*; FP16 312 | 624* (* = with sparsity).
    # A100 40GB SXM: 40GB HBM2, 1,555 GB/s; NVLink 3rd gen 600 GB/s.
    # Links: NVLink3 600 / 2 = 300 GB/s one way; reference node DGX A100 (8 GPUs, 8 x 200 Gb/s HDR).
    _nvidia(
        "a100-40gb",
        memory_bytes=40 * GiB,
        peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        memory_bandwidth_gbps=1555.0,
        interconnect="nvlink3",
        interconnect_gbps=600.0,
        intra_node_gbps=300.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_A100_HDR_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (2021, r4), A100 80GB SXM: 80GB HBM2e, 2,039 GB/s;
    # same compute as the 40GB part; NVLink 3rd gen 600 GB/s.
    # Links: as the 40GB part (NVLink3, DGX A100).
    _nvidia(
        "a100-80gb",
        memory_bytes=80 * GiB,
        peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        memory_bandwidth_gbps=2039.0,
        interconnect="nvlink3",
        interconnect_gbps=600.0,
        intra_node_gbps=300.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_A100_HDR_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column: FP32 67 TF; TF32 989*;
    # BF16 1,979*; FP16 1,979* (* = with sparsity; dense = half: 494.5 / 989.5). 80GB HBM3,
    # 3.35 TB/s; NVLink 4th gen 900 GB/s. CUDA reports 85,520,809,984 bytes of the 80 GiB.
    # Links: NVLink4 900 / 2 = 450 GB/s one way; reference node DGX H100 (8 GPUs, 8 x 400 Gb/s CX-7).
    _nvidia(
        "h100-sxm",
        memory_bytes=80 * GiB,
        peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
        memory_bandwidth_gbps=3350.0,
        interconnect="nvlink4",
        interconnect_gbps=900.0,
        intra_node_gbps=450.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_CX7_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 PCIe column: FP32 51 TF; TF32 756*;
    # BF16 1,513*; FP16 1,513* (dense = half: 378 / 756.5). 80GB HBM2e, 2 TB/s; PCIe Gen5
    # 128 GB/s (an optional NVLink bridge joins pairs at 600 GB/s; not assumed here).
    # Links: PCIe Gen5 x16 one way, 64 GB/s (the NVLink bridge joins pairs only). No reference node or
    # instance table was found for 8 x H100 PCIe: assumed the DGX H100 network, one 400 Gb/s NIC per
    # GPU (an upper bound: PCIe servers may share a NIC between GPUs).
    _nvidia(
        "h100-pcie",
        memory_bytes=80 * GiB,
        peak_tflops={"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
        memory_bandwidth_gbps=2000.0,
        interconnect="pcie5",
        interconnect_gbps=PCIE5_X16_GBPS,
        intra_node_gbps=PCIE5_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=DGX_CX7_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column: FP32 67 TF; TF32 989*;
    # BF16 1,979*; FP16 1,979* (dense = half, same die as H100 SXM). 141GB HBM3e, 4.8 TB/s;
    # NVLink 900 GB/s. (nvidia-smi shows 143,771 MiB, about 140.4 GiB.)
    # Links: as H100 SXM; reference node DGX H200 (same network as DGX H100: BasePOD RA, "Core Components").
    _nvidia(
        "h200",
        memory_bytes=141 * GiB,
        peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
        memory_bandwidth_gbps=4800.0,
        interconnect="nvlink4",
        interconnect_gbps=900.0,
        intra_node_gbps=450.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_CX7_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA HGX B200 specifications (nvidia.com HGX platform page, 2024), per GPU: FP32 75 TF;
    # TF32 2.2 PF*; FP16/BF16 4.5 PF* (* = with sparsity; dense = half: 1,100 / 2,250).
    # 180GB HBM3e; 8 TB/s (NVIDIA DGX B200 datasheet 2024: 64 TB/s for 8 GPUs; a later HGX
    # table prints 7.7 TB/s). NVLink 5th gen 1.8 TB/s. The die has 192GB; B200 boards expose 180.
    # Links: NVLink5 1,800 / 2 = 900 GB/s one way; reference node DGX B200 (8 GPUs, 8 x 400 Gb/s CX-7).
    _nvidia(
        "b200",
        memory_bytes=180 * GiB,
        peak_tflops={"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0},
        memory_bandwidth_gbps=8000.0,
        interconnect="nvlink5",
        interconnect_gbps=1800.0,
        intra_node_gbps=900.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_CX7_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA L4 Tensor Core GPU datasheet (2023): FP32 30.3 TF; TF32 120*; BF16 242*; FP16 242*
    # (* = with sparsity; dense = half: 60 / 121). 24GB GDDR6, 300 GB/s; PCIe Gen4 x16 64 GB/s.
    # Links: PCIe Gen4 x16 one way, 32 GB/s; reference node AWS g6.48xlarge (8 L4, 100 Gbps).
    _nvidia(
        "l4",
        memory_bytes=24 * GiB,
        peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
        memory_bandwidth_gbps=300.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=AWS_100G_8GPU_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA L40S GPU datasheet (2023): FP32 91.6 TF; TF32 183 | 366*; BF16 362.05 | 733*;
    # FP16 362.05 | 733*. 48GB GDDR6 with ECC, 864 GB/s; PCIe Gen4 x16 64 GB/s, no NVLink.
    # Links: PCIe Gen4 x16 one way, 32 GB/s; reference node AWS g6e.48xlarge (8 L40S, 400 Gbps per the EC2
    # G6e instance table): 50 Gb/s = 6.25 GB/s per GPU.
    _nvidia(
        "l40s",
        memory_bytes=48 * GiB,
        peak_tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
        memory_bandwidth_gbps=864.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=400 / 8 / 8,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # A10G is an AWS-only part (EC2 G5); NVIDIA publishes no datasheet for it. Figures as AWS
    # and NVIDIA state them for G5 (24GB GDDR6, 600 GB/s, FP32 35 TF) with tensor rates at the
    # GA102 fp32-accumulate rate: TF32 35, BF16/FP16 70 dense -- half the A10's (NVIDIA A10
    # Tensor Core GPU datasheet, 2021: TF32 62.5, BF16/FP16 125). Least certain entry here.
    # Links: PCIe Gen4 x16 one way, 32 GB/s; reference node AWS g5.48xlarge (8 A10G, 100 Gbps).
    _nvidia(
        "a10g",
        memory_bytes=24 * GiB,
        peak_tflops={"fp32": 35.0, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0},
        memory_bandwidth_gbps=600.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=AWS_100G_8GPU_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
    # NVIDIA T4 Tensor Core GPU datasheet (2019): FP32 8.1 TF; mixed precision (FP16/FP32)
    # 65 TF. 16GB GDDR6, 320 GB/s; PCIe Gen3 x16 32 GB/s. Turing: no BF16, no TF32.
    # Links: PCIe Gen3 x16 one way, 16 GB/s; reference node AWS g4dn.metal (8 T4, 100 Gbps).
    _nvidia(
        "t4",
        memory_bytes=16 * GiB,
        peak_tflops={"fp32": 8.1, "fp16": 65.0},
        memory_bandwidth_gbps=320.0,
        interconnect="pcie3",
        interconnect_gbps=PCIE3_X16_GBPS,
        intra_node_gbps=PCIE3_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=AWS_100G_8GPU_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_bf16=False,
    ),
    # NVIDIA V100 Tensor Core GPU datasheet (2020), V100 SXM2 column: FP32 15.7 TF; Tensor
    # (FP16 in, FP32 accumulate) 125 TF. 32GB HBM2, 900 GB/s; NVLink 2nd gen 300 GB/s.
    # Volta: no BF16, no TF32.
    # Links: NVLink2 300 / 2 = 150 GB/s one way (DGX-1's hybrid cube-mesh links every GPU to four others;
    # NCCL rings over it). Reference node DGX-1 with V100 (NVIDIA DGX-1 with Tesla V100 System Architecture
    # white paper): 8 GPUs, four 100 Gb/s EDR InfiniBand NICs: 50 Gb/s = 6.25 GB/s per GPU.
    _nvidia(
        "v100",
        memory_bytes=32 * GiB,
        peak_tflops={"fp32": 15.7, "fp16": 125.0},
        memory_bandwidth_gbps=900.0,
        interconnect="nvlink2",
        interconnect_gbps=300.0,
        intra_node_gbps=150.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=4 * 100 / 8 / 8,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_bf16=False,
    ),
    # Same datasheet, the 16GB V100 SXM2: identical compute and bandwidth, 16GB HBM2.
    # Links: as the 32GB V100 (NVLink2, DGX-1).
    _nvidia(
        "v100-16gb",
        memory_bytes=16 * GiB,
        peak_tflops={"fp32": 15.7, "fp16": 125.0},
        memory_bandwidth_gbps=900.0,
        interconnect="nvlink2",
        interconnect_gbps=300.0,
        intra_node_gbps=150.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=4 * 100 / 8 / 8,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_bf16=False,
    ),
    # NVIDIA Ada GPU Architecture whitepaper (v1.01, 2022/2023), Appendix, GeForce RTX 4090:
    # FP32 82.6 TF; TF32 tensor 82.6 | 165.2*; BF16 (FP32 accumulate) 165.2 | 330.4*; FP16 with
    # FP32 accumulate 165.2 | 330.4* (330.3 with FP16 accumulate, which autocast does not use).
    # 24GB GDDR6X, 1,008 GB/s; PCIe Gen4 x16, no NVLink.
    # Links: PCIe Gen4 x16 one way, 32 GB/s. No vendor reference node or cloud instance table was found
    # for GeForce cards: assumed a 4-GPU workstation on 10 GbE (10 Gb/s / 4 = 0.3125 GB/s per GPU).
    _nvidia(
        "rtx-4090",
        memory_bytes=24 * GiB,
        peak_tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
        memory_bandwidth_gbps=1008.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=10 / 4 / 8,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=4,
        supports_tf32=True,
    ),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper (v2.1, 2021), Appendix, GeForce RTX 3090:
    # FP32 35.6 TF; TF32 35.6 | 71*; BF16 (FP32 accumulate) 71 | 142*; FP16 with FP32
    # accumulate 71 | 142* (142 with FP16 accumulate). 24GB GDDR6X, 936 GB/s. PCIe Gen4 x16;
    # an optional NVLink bridge joins two cards at 112.5 GB/s, not assumed here.
    # Links: as the RTX 4090 (PCIe Gen4, no bridge assumed; an assumed 4-GPU workstation on 10 GbE).
    _nvidia(
        "rtx-3090",
        memory_bytes=24 * GiB,
        peak_tflops={"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
        memory_bandwidth_gbps=936.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=10 / 4 / 8,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=4,
        supports_tf32=True,
    ),
    # AMD Instinct MI300X Accelerator data sheet (2023): FP32 vector/matrix 163.4 TF; TF32
    # 653.7 TF; FP16 1,307.4 TF; BF16 1,307.4 TF (dense; the sheet lists sparsity separately:
    # 1,307.4 / 2,614.9). 192GB HBM3, 5.3 TB/s. 7 Infinity Fabric links x 128 GB/s = 896 GB/s.
    # PyTorch on ROCm uses TF32 only when opted in; the flag states the hardware capability.
    # Links: Infinity Fabric 896 / 2 = 448 GB/s one way to the seven peers (64 GB/s to any one of them).
    # RCCL keeps NCCL's tuning model (its tables are tuned per release); NCCL's NVLink figures stand in. Reference
    # node Azure ND MI300X v5 (8 GPUs; InfiniBand 8 x 400 Gb/s NDR, Microsoft's ND MI300X v5 size page).
    Accelerator(
        name="mi300x",
        vendor="amd",
        memory_bytes=192 * GiB,
        peak_tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
        memory_bandwidth_gbps=5300.0,
        interconnect="infinity-fabric",
        interconnect_gbps=896.0,
        intra_node_gbps=448.0,
        intra_node_latency_us=NCCL_NVLINK_STEP_US,
        inter_node_gbps=DGX_CX7_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
        multiprocessors=304,  # the same data sheet: 304 compute units
        max_threads_per_multiprocessor=2048,  # HIP's hipDeviceProp_t on CDNA3 (gfx942)
    ),
    # A generic host CPU, no datasheet: nominal figures for a 16-core AVX2 server socket
    # (16 cores x 2.0 GHz x 32 fp32 FLOP/cycle = 1.0 TF; dual-channel DDR4-3200 = 51.2 GB/s),
    # and 64 GiB of host memory as its "device memory". `get_hardware("cpu")` and
    # `get_hardware("local")` replace the memory with this machine's /proc/meminfo figure.
    # bf16 runs (autocast on CPU) but gains nothing without AMX/AVX512-BF16, so its peak equals
    # fp32; fp16 autocast on CPU is not a supported training path.
    # Links: gloo over TCP, no NCCL figures apply. Within a node (loopback): gloo's all_reduce of 2 ranks on a
    # quiet 2-CPU host moves 64 MiB at 1.5-1.6 GB/s of bus bandwidth and a 4-byte tensor in 250-430 us over
    # its 2 ring steps, 125-215 us a step (bench/research/gloo_links.py, bench/results/archive/gloo_links.json).
    # Between nodes: no measurement;
    # assumed 10 GbE (1.25 GB/s), the onboard NIC class of servers (DGX H100 carries a 10 Gb/s one), at the
    # loopback per-step latency as its floor. One CPU "device" per node.
    Accelerator(
        name="cpu",
        vendor="cpu",
        memory_bytes=64 * GiB,
        peak_tflops={"fp32": 1.0, "bf16": 1.0},
        memory_bandwidth_gbps=51.2,
        interconnect="none",
        interconnect_gbps=0.0,
        intra_node_gbps=1.5,
        intra_node_latency_us=200.0,
        inter_node_gbps=1.25,
        inter_node_latency_us=200.0,
        devices_per_node=1,
        supports_bf16=True,
        supports_fp16=False,
    ),
    # Synthetic, for tests (STYLE: every registry has a `tiny` entry): a 1 GiB GPU that small
    # workloads overflow quickly. Not a real device; never chosen by the local probe.
    # Links: synthetic, an 8-GPU PCIe Gen4 node on 100 Gbps (the L4 entry's figures).
    _nvidia(
        "tiny",
        memory_bytes=1 * GiB,
        peak_tflops={"fp32": 1.0, "tf32": 2.0, "bf16": 4.0, "fp16": 4.0},
        memory_bandwidth_gbps=100.0,
        interconnect="pcie4",
        interconnect_gbps=PCIE4_X16_GBPS,
        intra_node_gbps=PCIE4_X16_ONE_WAY_GBPS,
        intra_node_latency_us=NCCL_PCI_STEP_US,
        inter_node_gbps=AWS_100G_8GPU_GBPS,
        inter_node_latency_us=NCCL_NET_STEP_US,
        devices_per_node=8,
        supports_tf32=True,
    ),
]

CATALOG: dict[str, Accelerator] = {entry.name: entry for entry in _ENTRIES}

# NVML/CUDA product names -> catalog keys, first match wins (searched in the lower-cased name).
# Variants without an entry of their own map to the closest one; `get_hardware("local")`
# substitutes the probed memory, so only the peak figures are borrowed.
_GPU_NAME_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern), key)
    for pattern, key in [
        (r"\bh100\b.*\b(pcie|nvl)\b", "h100-pcie"),  # "NVIDIA H100 PCIe", "NVIDIA H100 NVL" (PCIe card)
        (r"\bh100\b", "h100-sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
        (r"\bg?h200\b", "h200"),  # "NVIDIA H200", GH200's Hopper GPU
        (r"\bb200\b", "b200"),
        (r"\ba100\b.*\b80gb\b", "a100-80gb"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
        (r"\ba100\b", "a100-40gb"),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
        (r"\bl40s?\b", "l40s"),
        (r"\bl4\b", "l4"),
        (r"\ba10g?\b", "a10g"),  # the A10 has the A10G's memory system and more tensor throughput
        (r"\bt4\b", "t4"),
        (r"\bv100s?\b.*\b16gb\b", "v100-16gb"),
        (r"\bv100s?\b", "v100"),  # "Tesla V100-SXM2-32GB"
        (r"\brtx 4090\b", "rtx-4090"),
        (r"\brtx 3090\b", "rtx-3090"),  # and the 3090 Ti
        (r"\bmi300x\b", "mi300x"),
    ]
]


def catalog_key_for_gpu(name: str) -> str | None:
    """The catalog key for a GPU product name as NVML reports it, or None if none fits."""
    lowered = name.lower()
    for pattern, key in _GPU_NAME_RULES:
        if pattern.search(lowered):
            return key
    return None
