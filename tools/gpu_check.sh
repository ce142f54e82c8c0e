#!/usr/bin/env bash
# AutoSP's GPU checks on a one-GPU machine (about 9 minutes on an H200), one JSON out.
#
#   tools/scripts/gpu_wheels.sh        # here, first, where the GPU machine reaches no package index
#   tools/gpu_check.sh                 # writes $OUT/gpu_check.json (or ./gpu_check.json)
#   tools/gpu_check.sh path/to.json    # writes there
#   tools/gpu_check.sh out.json --device cpu --quick   # the CPU self-test of this script
#
# Stages (each recorded even when another fails): env, equivalence (autosp.verify, 2 processes
# sharing the GPU over gloo), flex (FlexAttention's values and gradients), sac_kernels (flash / efficient / cuDNN SDPA: attention saved, never
# recomputed), plan_vs_measured (autosp-plan against torch.cuda.max_memory_allocated at sp=1 and
# rank 0 of sp=8 under a fake group), step_time (bf16, AutoSP against compiled hand-written Ulysses),
# overlap_trace (exchanges in flight while CUDA kernels run; gzipped Chrome traces beside the JSON).
# On the device tool (10 minutes a call): carry .whl and run it as two calls, each timeout_s 600,
#   --stages env,equivalence,flex,plan_vs_measured   then   --stages env,sac_kernels,step_time,overlap_trace
set -u -o pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-${OUT:-.}/gpu_check.json}"
[ $# -gt 0 ] && shift
py="${PYTHON:-$(command -v python || command -v python3)}"
root="$here/.."
if ls "$root"/.whl/autosp_core-*.whl >/dev/null 2>&1; then
    # Wheels from tools/scripts/gpu_wheels.sh (a machine that reaches no index): --no-deps keeps the
    # machine's CUDA torch; a target folder, since its site-packages may not be writable.
    site="${TMPDIR:-/tmp}/autosp-gpu-site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$root"/.whl/*.whl || { echo "gpu_check: could not install $root/.whl/*.whl" >&2; exit 2; }
    export PYTHONPATH="$site:$root/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$py" -c "import autosp_tools, autosp_sac, autosp_ring" 2>/dev/null; then
    # A bare checkout: install the workspace editable; --no-deps keeps the machine's CUDA torch
    # (plugins are found through entry points, so PYTHONPATH alone would not do). Building needs
    # hatchling: without an index, use tools/scripts/gpu_wheels.sh instead.
    "$py" -m pip install -q --no-deps -e "$root/packages/autosp-core" -e "$root/packages/autosp-ulysses" \
        -e "$root/packages/autosp-sac" -e "$root/packages/autosp-ring" -e "$root/tools" \
        || { echo "gpu_check: could not install the AutoSP packages with $py -m pip" >&2; exit 2; }
    "$py" -c "import pluggy" 2>/dev/null || "$py" -m pip install -q pluggy
fi
# Stay inside the 10 minutes; the JSON is written after every stage, so a timeout keeps what ran.
exec timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT:-590}" "$py" -m autosp_tools.plan.gpu_check --out "$out" "$@"
