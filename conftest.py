"""Settings for every test process pytest starts (the spawned ranks set theirs in spmd_pool)."""

import torch._inductor.config as inductor_config

# Scalar Inductor kernels: see integration_tests/spmd_pool.py, quick_inductor_kernels.
inductor_config.cpp.simdlen = 1
