"""AutoSP on AMD GPUs (ROCm): what differs from CUDA, registered through the ``autosp`` entry points."""

from autosp_rocm.detect import RocmDevice, detect, is_rocm_build
from autosp_rocm.kernels import lse_base, rocm_kernels
from autosp_rocm.profiles import MI250X, MI300X, MI325X, MI355X, ROCM_PROFILES
from autosp_rocm.rccl import RCCL_SETTINGS, apply_rccl_settings

__all__ = [
    "MI250X",
    "MI300X",
    "MI325X",
    "MI355X",
    "RCCL_SETTINGS",
    "ROCM_PROFILES",
    "RocmDevice",
    "apply_rccl_settings",
    "detect",
    "is_rocm_build",
    "lse_base",
    "rocm_kernels",
]
