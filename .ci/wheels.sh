#!/usr/bin/env bash
# CI: every member builds an sdist and, from it, a wheel (offline: hatchling is in the dev env);
# autosp-core + autosp-ulysses installed from those wheels into a clean venv run an sp=2 program
# against single-device eager; each other pass package installs on autosp-core alone and registers.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dist=$work/dist
members=(packages/* plugins/* tools)
# This machine's pip config names index folders that do not all exist; torch without numpy warns.
quiet() { "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
stage() { echo "wheels.sh: $1 (${SECONDS}s)"; }

# One hatch call: each `hatch run` checks the whole workspace's dependencies first.
py=$(hatch run python -c 'import sys; print(sys.executable)')
for member in "${members[@]}"; do
  cmp -s LICENSE "$member/LICENSE" || { echo "$member/LICENSE differs from the top-level LICENSE" >&2; exit 1; }
  "$py" -m build --no-isolation --outdir "$dist" "$member" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; echo "building $member failed" >&2; exit 1; }
done
"$py" - "$dist" "${members[@]}" <<'PY'
import sys, tarfile, tomllib, zipfile
from pathlib import Path

dist, members = Path(sys.argv[1]), sys.argv[2:]
for member in members:
    project = tomllib.loads(Path(member, "pyproject.toml").read_text())["project"]
    stem = f"{project['name'].replace('-', '_')}-{project['version']}"
    wheel = zipfile.ZipFile(dist / f"{stem}-py3-none-any.whl").namelist()
    sdist = tarfile.open(dist / f"{stem}.tar.gz").getnames()
    need = {"py.typed": any(n.endswith("/py.typed") for n in wheel),
            "LICENSE in wheel": f"{stem}.dist-info/licenses/LICENSE" in wheel,
            "LICENSE in sdist": f"{stem}/LICENSE" in sdist}
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        sys.exit(f"{stem}: missing {', '.join(missing)}")
print(f"built and checked {len(members)} sdists and wheels")
PY

stage "built"
venv=$work/venv
python3 -m venv "$venv"
# No byte-compiling of the packages at install (torch has thousands of modules): this venv imports few,
# and the first process to import a module writes its bytecode for the next: every check below imports
# torch._dynamo, which with PYTHONDONTWRITEBYTECODE set each compiled anew (the script: 143 s, 109 s without).
unset PYTHONDONTWRITEBYTECODE
pip=(quiet "$venv/bin/python" -m pip install -q --no-compile)
"${pip[@]}" torch==2.13.0 pluggy  # the CPU torch wheel on this machine's disk (see ENVIRONMENT.md)
# --no-index: the members' own dependency ranges must resolve to the wheels just built.
"${pip[@]}" --no-index --find-links "$dist" autosp-core autosp-ulysses
"$venv/bin/python" -c 'import autosp, sys; assert autosp.__file__.startswith(sys.prefix), autosp.__file__'
stage "venv with torch, autosp-core, autosp-ulysses"
"$venv/bin/python" .ci/wheel_sp2.py
stage "sp=2 program"

"$venv/bin/python" -m pip uninstall -q -y autosp-ulysses
for member in packages/* plugins/*; do
  package=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$member/pyproject.toml")
  [[ $package == autosp-core || $package == autosp-ulysses ]] && continue
  "${pip[@]}" --no-index --find-links "$dist" "$package"
  "$venv/bin/python" .ci/wheel_plugin.py "$package"
  "$venv/bin/python" -m pip uninstall -q -y "$package"
done
stage "every other pass package on autosp-core alone"
