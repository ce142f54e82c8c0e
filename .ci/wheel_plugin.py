"""One pass package installed from its wheel on top of autosp-core alone: it imports and registers.

Usage: python wheel_plugin.py DISTRIBUTION. Run by .ci/wheels.sh in a venv with torch, pluggy,
autosp-core and that one package; any other AutoSP distribution being installed is an error.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

# The registry's tables a plugin can add to (``autosp.registry.Registry``).
TABLES = ("passes", "variants", "attention", "hardware", "sharding_rules")
# What the packages of this repository must register, on top of "something" for any other.
EXPECTED = {
    "autosp-ring": ("variants", {"ring", "hybrid"}),
    "autosp-sac": ("passes", {"sac.policy"}),
    "autosp-window": ("attention", {"sliding_window"}),
}


def added_by(dist_name: str) -> dict[str, set[str]]:
    """What the plugin adds: the registry with it against the registry with it blocked."""
    from autosp.registry import BLOCK_ENV, build_registry

    with_it = build_registry()
    if dist_name not in with_it.plugin_names():
        sys.exit(f"{dist_name} is installed but not registered; registered plugins: {with_it.plugin_names()}")
    os.environ[BLOCK_ENV] = dist_name
    without = build_registry()
    del os.environ[BLOCK_ENV]
    return {t: {str(k) for k in set(getattr(with_it, t)) - set(getattr(without, t))} for t in TABLES}


def main(dist_name: str) -> int:
    ours = {d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith("autosp-")}
    if ours != {"autosp-core", dist_name}:
        sys.exit(f"expected exactly autosp-core and {dist_name} installed, found {sorted(ours)}")
    added = added_by(dist_name)
    if not any(added.values()):
        sys.exit(f"{dist_name} registered nothing (tables {', '.join(TABLES)})")
    if dist_name in EXPECTED:
        table, names = EXPECTED[dist_name]
        if missing := names - added[table]:
            sys.exit(f"{dist_name} registered no {table} named {sorted(missing)}; it added {added}")
    summary = "; ".join(f"{t}: {', '.join(sorted(n))}" for t, n in added.items() if n)
    print(f"{dist_name} {metadata.version(dist_name)} on autosp-core {metadata.version('autosp-core')}: {summary}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
