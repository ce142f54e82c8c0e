#!/usr/bin/env bash
# Wheels for tools/gpu_check.sh on a GPU machine that cannot reach an index (the device tool's H200):
# AutoSP's packages built here, and DeepSpeed (the hand-written Ulysses baseline) with the
# dependencies the GPU image lacks. Writes .whl/ (git-ignored: `echo /.whl/ >> .git/info/exclude`);
# carry it with the run, and gpu_check.sh installs from it with --no-deps (the machine's torch stays).
#
#   tools/scripts/gpu_wheels.sh [python-version-of-the-gpu-image, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver="${1:-3.12}"
py=$(hatch run python -c 'import sys; print(sys.executable)')
rm -rf .whl && mkdir -p .whl/site
for member in packages/autosp-core packages/autosp-ulysses packages/autosp-sac packages/autosp-ring tools; do
  "$py" -m build --no-isolation --wheel --outdir .whl "$member" >.whl/build.log 2>&1 || { cat .whl/build.log >&2; exit 1; }
done
# DeepSpeed ships no wheel: its installed tree goes as is (pure Python with DS_BUILD_OPS=0).
site=$("$py" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("deepspeed").submodule_search_locations[0]))')
cp -r "$site"/deepspeed "$site"/deepspeed-*.dist-info .whl/site/
find .whl/site -name __pycache__ -prune -exec rm -rf {} +
rm .whl/build.log
pins=$("$py" -m pip list --format=freeze 2>/dev/null | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|hjson)==')
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $pins 2> >(grep -v "^WARNING: Location" >&2)
du -sh .whl
