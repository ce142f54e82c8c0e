"""Built-in profiles: NVIDIA data-center GPUs (dense, not 2:4-sparse, figures), the host CPU, an unknown GPU.

Every number names its source. Data sheets quote Tensor Core figures "with sparsity"; the
dense figure used here is half of it. Interconnect bandwidth is per direction (data sheets
quote NVLink bidirectional totals: 600 / 900 / 1800 GB/s are 300 / 450 / 900 GB/s each way).
AMD Instinct profiles come with the autosp-rocm package.
"""

from __future__ import annotations

import os

from autosp.hardware import AttentionKernel, HardwareProfile, Interconnect

GB = 1e9  # data sheets use decimal units
TB = 1e12
TFLOPS = 1e12

# PyTorch's CUDA SDPA kernels (torch/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.13):
# FlashAttention-2 takes GQA and head dims up to 256 in fp16/bf16; the memory-efficient
# (CUTLASS) kernel takes fp32 too but needs as many k/v heads as q heads.
NVIDIA_KERNELS = (
    AttentionKernel("flash", gqa=True, max_head_dim=256, dtypes=("float16", "bfloat16"), note="FlashAttention-2"),
    AttentionKernel("efficient", gqa=False, dtypes=("float16", "bfloat16", "float32"), note="CUTLASS mem-efficient"),
)

# HGX baseboards connect 8 GPUs through NVSwitch: every pair at the full per-GPU rate.
A100_80GB = HardwareProfile(
    "a100-80gb",
    "cuda",
    match=("A100-SXM4-80GB", "A100 80GB", "A100-80GB"),
    vendor="nvidia",
    arch="sm_80",
    # NVIDIA A100 Tensor Core GPU data sheet (2021), SXM: FP32 19.5 TF; TF32 156 TF, BF16/FP16 312 TF
    # dense (312 / 624 with sparsity).
    matmul_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
    memory_bytes=80 * 10**9,  # same data sheet: 80 GB HBM2e
    memory_bandwidth=2039 * GB,  # same data sheet: 2,039 GB/s
    # same data sheet: NVLink 600 GB/s (third-generation NVLink, bidirectional)
    interconnect=Interconnect("NVLink 3 via NVSwitch", 300 * GB, "switch", 8),
    attention_kernels=NVIDIA_KERNELS,
    source="NVIDIA A100 Tensor Core GPU data sheet, SXM 80GB, dense",
)

A100_40GB = HardwareProfile(
    "a100-40gb",
    "cuda",
    match=("A100",),
    vendor="nvidia",
    arch="sm_80",
    matmul_flops=dict(A100_80GB.matmul_flops),  # same data sheet: the compute figures do not depend on memory
    memory_bytes=40 * 10**9,  # same data sheet: 40 GB HBM2
    memory_bandwidth=1555 * GB,  # same data sheet: 1,555 GB/s
    interconnect=A100_80GB.interconnect,
    attention_kernels=NVIDIA_KERNELS,
    source="NVIDIA A100 Tensor Core GPU data sheet, SXM 40GB, dense",
)

H100_80GB = HardwareProfile(
    "h100-80gb",
    "cuda",
    match=("H100",),
    vendor="nvidia",
    arch="sm_90",
    # NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: FP32 67 TF; TF32 989 TF, BF16/FP16 1,979 TF,
    # FP8 3,958 TF "with sparsity" -> 494.5 / 989.5 / 1,979 dense.
    matmul_flops={
        "float32": 67 * TFLOPS,
        "tf32": 494.5 * TFLOPS,
        "bfloat16": 989.5 * TFLOPS,
        "float16": 989.5 * TFLOPS,
        "float8": 1979 * TFLOPS,
    },
    memory_bytes=80 * 10**9,  # same data sheet: 80 GB HBM3
    memory_bandwidth=3.35 * TB,  # same data sheet: 3.35 TB/s
    interconnect=Interconnect("NVLink 4 via NVSwitch", 450 * GB, "switch", 8),  # same data sheet: NVLink 900 GB/s
    attention_kernels=NVIDIA_KERNELS,
    source="NVIDIA H100 Tensor Core GPU data sheet, H100 SXM, dense",
)

H200 = HardwareProfile(
    "h200",
    "cuda",
    match=("H200",),
    vendor="nvidia",
    arch="sm_90",
    # NVIDIA H200 Tensor Core GPU data sheet, H200 SXM: the same Tensor Core figures as H100 SXM
    # (BF16 1,979 TF, FP8 3,958 TF with sparsity).
    matmul_flops=dict(H100_80GB.matmul_flops),
    memory_bytes=141 * 10**9,  # same data sheet: 141 GB HBM3e
    memory_bandwidth=4.8 * TB,  # same data sheet: 4.8 TB/s
    interconnect=Interconnect("NVLink 4 via NVSwitch", 450 * GB, "switch", 8),  # same data sheet: NVLink 900 GB/s
    attention_kernels=NVIDIA_KERNELS,
    source="NVIDIA H200 Tensor Core GPU data sheet, H200 SXM, dense",
)

B200 = HardwareProfile(
    "b200",
    "cuda",
    match=("B200",),
    vendor="nvidia",
    arch="sm_100",
    # NVIDIA HGX B200 data sheet, per GPU: FP32 75 TF; TF32 2.2 PF, BF16/FP16 4.5 PF, FP8 9 PF
    # with sparsity -> 1.1 / 2.25 / 4.5 PF dense.
    matmul_flops={
        "float32": 75 * TFLOPS,
        "tf32": 1100 * TFLOPS,
        "bfloat16": 2250 * TFLOPS,
        "float16": 2250 * TFLOPS,
        "float8": 4500 * TFLOPS,
    },
    memory_bytes=180 * 10**9,  # same data sheet: 180 GB HBM3E per GPU (1.4 TB per 8-GPU board)
    memory_bandwidth=7.7 * TB,  # same data sheet: 7.7 TB/s per GPU
    interconnect=Interconnect("NVLink 5 via NVSwitch", 900 * GB, "switch", 8),  # same data sheet: NVLink 1.8 TB/s
    attention_kernels=NVIDIA_KERNELS,
    source="NVIDIA HGX B200 data sheet, per GPU, dense",
)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# Not a data sheet: a few x86 cores in fp32, and gloo between processes of one host. Measure
# yours with autosp-profile. Attention and the ring's blocks measured on the 2-core development
# VM, one thread per rank: causal SDPA 14-39 GFLOP/s (forward FLOPs, fwd+bwd time), the ring op's
# fp32 blocks (scores materialised) 4-13 GFLOP/s.
CPU = HardwareProfile(
    "cpu",
    "cpu",
    vendor="cpu",
    default_dtype="float32",
    matmul_flops={"float32": 5e10, "bfloat16": 2.5e10},
    attention_flops={"float32": 2e10},
    kernel_flops={"ring-block/float32": 6e9},
    memory_bytes=_host_memory(),  # this machine's physical memory
    memory_bandwidth=2e10,
    interconnect=Interconnect("gloo over host memory", 2e9, "host", os.cpu_count() or 1, latency=1e-4),
    attention_kernels=(
        AttentionKernel("cpu-flash", gqa=True, note="aten _scaled_dot_product_flash_attention_for_cpu"),
    ),
    source="rough figures for a few x86 cores and gloo; run autosp-profile",
)

# A CUDA device no built-in profile names: order-of-magnitude figures, never matched by name.
CUDA_GENERIC = HardwareProfile(
    "cuda",
    "cuda",
    vendor="",
    default_dtype="bfloat16",
    matmul_flops={"bfloat16": 1e14, "float32": 2e13},
    interconnect=Interconnect("unknown GPU links", 1e11, "switch", 8),
    attention_kernels=NVIDIA_KERNELS,
    source="placeholder for an unrecognised GPU; run autosp-profile or pass hardware=",
)

BUILTIN_PROFILES = (CPU, CUDA_GENERIC, A100_40GB, A100_80GB, H100_80GB, H200, B200)

__all__ = [
    "A100_40GB",
    "A100_80GB",
    "B200",
    "BUILTIN_PROFILES",
    "CPU",
    "CUDA_GENERIC",
    "H100_80GB",
    "H200",
    "NVIDIA_KERNELS",
]
