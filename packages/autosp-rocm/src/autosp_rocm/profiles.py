"""AMD Instinct profiles from AMD's data sheets (dense figures; AMD quotes sparsity separately).

Interconnect bandwidth is per direction. An MI250X is two GCDs, and PyTorch sees each GCD as
one device, so its profile is per GCD (half the package's compute, memory and bandwidth).
"""

from __future__ import annotations

from autosp.hardware import HardwareProfile, Interconnect
from autosp_rocm.kernels import rocm_kernels

GB = 1e9
TB = 1e12
TFLOPS = 1e12


def _mi250x_peers() -> tuple[tuple[float, ...], ...]:
    # HPE Cray EX235a node (OLCF Frontier User Guide, node diagram): 4 MI250X = 8 GCDs. The two
    # GCDs of one package share 4 xGMI links (200 GB/s per direction); GCDs of different packages
    # have 1 or 2 links (50 or 100 GB/s). Which pairs have two depends on the board, so every
    # cross-package pair here is the one-link lower bound; autosp-profile measures the real one.
    same_package, cross = 200 * GB, 50 * GB
    return tuple(
        tuple(0.0 if i == j else (same_package if i // 2 == j // 2 else cross) for j in range(8)) for i in range(8)
    )


MI250X = HardwareProfile(
    "mi250x",
    "cuda",
    match=("MI250X", "MI250"),
    vendor="amd",
    arch="gfx90a",
    # AMD Instinct MI250X data sheet (per OAM, two GCDs): FP16/BF16 matrix 383 TF, FP32 matrix 95.7 TF;
    # halved per GCD. No sparsity figures: these are dense.
    matmul_flops={"float32": 47.85 * TFLOPS, "bfloat16": 191.5 * TFLOPS, "float16": 191.5 * TFLOPS},
    memory_bytes=64 * 10**9,  # same data sheet: 128 GB HBM2e per OAM -> 64 GB per GCD
    memory_bandwidth=1.6384 * TB,  # same data sheet: 3.2768 TB/s per OAM -> per GCD
    # Uneven: sp=2 on one package gets 200 GB/s; a ring across packages runs at the slowest hop.
    interconnect=Interconnect(
        "Infinity Fabric (xGMI), GCD to GCD", 200 * GB, "uneven", 8, peer_bandwidth=_mi250x_peers()
    ),
    attention_kernels=rocm_kernels(),
    source="AMD Instinct MI250X data sheet, per GCD; links from the OLCF Frontier node diagram",
)

# MI300X / MI325X platforms: 8 OAMs, each with 7 Infinity Fabric links, one to every peer.
_MI300_LINKS = Interconnect("Infinity Fabric (xGMI), fully connected", 7 * 64 * GB, "mesh", 8, link_bandwidth=64 * GB)

MI300X = HardwareProfile(
    "mi300x",
    "cuda",
    match=("MI300X",),
    vendor="amd",
    arch="gfx942",
    # AMD Instinct MI300X data sheet: TF32 653.7 TF, FP16/BF16 1307.4 TF, FP8 2614.9 TF dense
    # (sparsity doubles them); FP32 matrix 163.4 TF.
    matmul_flops={
        "float32": 163.4 * TFLOPS,
        "tf32": 653.7 * TFLOPS,
        "bfloat16": 1307.4 * TFLOPS,
        "float16": 1307.4 * TFLOPS,
        "float8": 2614.9 * TFLOPS,
    },
    memory_bytes=192 * 10**9,  # same data sheet: 192 GB HBM3
    memory_bandwidth=5.3 * TB,  # same data sheet: 5.3 TB/s
    # same data sheet: 7 Infinity Fabric links, 128 GB/s each (bidirectional) -> 64 GB/s per direction
    interconnect=_MI300_LINKS,
    attention_kernels=rocm_kernels(),
    source="AMD Instinct MI300X data sheet, dense",
)

MI325X = HardwareProfile(
    "mi325x",
    "cuda",
    match=("MI325X",),
    vendor="amd",
    arch="gfx942",
    matmul_flops=dict(MI300X.matmul_flops),  # AMD Instinct MI325X data sheet: the MI300X's compute figures
    memory_bytes=256 * 10**9,  # same data sheet: 256 GB HBM3E
    memory_bandwidth=6.0 * TB,  # same data sheet: 6 TB/s
    interconnect=_MI300_LINKS,  # same data sheet: 7 links, 128 GB/s each
    attention_kernels=rocm_kernels(),
    source="AMD Instinct MI325X data sheet, dense",
)

MI355X = HardwareProfile(
    "mi355x",
    "cuda",
    match=("MI355X", "MI350X"),
    vendor="amd",
    arch="gfx950",
    # AMD Instinct MI355X data sheet: FP16/BF16 2.5 PF, FP8 5.0 PF dense (sparsity doubles them);
    # FP32 157.3 TF; no TF32.
    matmul_flops={
        "float32": 157.3 * TFLOPS,
        "bfloat16": 2516.6 * TFLOPS,
        "float16": 2516.6 * TFLOPS,
        "float8": 5033.2 * TFLOPS,
    },
    memory_bytes=288 * 10**9,  # same data sheet: 288 GB HBM3E
    memory_bandwidth=8.0 * TB,  # same data sheet: 8 TB/s
    # same data sheet: 7 Infinity Fabric links at 153.6 GB/s (bidirectional) -> 76.8 GB/s per direction
    interconnect=Interconnect(
        "Infinity Fabric (xGMI), fully connected", 7 * 76.8 * GB, "mesh", 8, link_bandwidth=76.8 * GB
    ),
    attention_kernels=rocm_kernels(experimental=True),
    source="AMD Instinct MI355X data sheet, dense",
)

ROCM_PROFILES = (MI250X, MI300X, MI325X, MI355X)

__all__ = ["MI250X", "MI300X", "MI325X", "MI355X", "ROCM_PROFILES"]
