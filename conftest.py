"""Settings for every test process pytest starts, and through the environment for every process they spawn."""

import os

# Scalar Inductor kernels, without probing the vector ISAs (see integration_tests/spmd_pool.py,
# quick_inductor_kernels). Set in the environment too, so that ranks the tools spawn (autosp-bench,
# autosp-sac-bench's DeepSpeed run, autosp-train) compile the same way.
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"

import torch._inductor.config as inductor_config  # noqa: E402 - reads the variable above

inductor_config.cpp.simdlen = 1
inductor_config.cpp.vec_isa_ok = False
