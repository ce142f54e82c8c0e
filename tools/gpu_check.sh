#!/usr/bin/env bash
# AutoSP's GPU checks on a one-GPU machine (about 10 minutes on an H100/H200), one JSON out.
#
#   tools/gpu_check.sh                 # writes $OUT/gpu_check.json (or ./gpu_check.json)
#   tools/gpu_check.sh path/to.json    # writes there
#   tools/gpu_check.sh out.json --device cpu --quick   # the CPU self-test of this script
#
# Stages (each recorded even when another fails): env, equivalence (autosp.verify, 2 processes
# sharing the GPU over gloo), sac_kernels (flash / efficient / cuDNN SDPA: attention saved, never
# recomputed), plan_vs_measured (autosp-plan against torch.cuda.max_memory_allocated at sp=1 and
# rank 0 of sp=8 under a fake group), step_time (bf16, AutoSP against compiled hand-written Ulysses).
set -u -o pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-${OUT:-.}/gpu_check.json}"
[ $# -gt 0 ] && shift
py="${PYTHON:-python}"
if ! "$py" -c "import autosp_tools, autosp_sac, autosp_ring" 2>/dev/null; then
    # A bare checkout: install the workspace editable; --no-deps keeps the machine's CUDA torch
    # (plugins are found through entry points, so PYTHONPATH alone would not do).
    root="$here/.."
    "$py" -m pip install -q --no-deps -e "$root/packages/autosp-core" -e "$root/packages/autosp-ulysses" \
        -e "$root/packages/autosp-sac" -e "$root/packages/autosp-ring" -e "$root/tools" \
        || { echo "gpu_check: could not install the AutoSP packages with $py -m pip" >&2; exit 2; }
    "$py" -c "import pluggy" 2>/dev/null || "$py" -m pip install -q pluggy
fi
# Stay inside the 10 minutes; the JSON is written after every stage, so a timeout keeps what ran.
exec timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT:-590}" "$py" -m autosp_tools.plan.gpu_check --out "$out" "$@"
