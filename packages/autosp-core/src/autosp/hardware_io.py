"""Hardware profiles as JSON, and by name.

A JSON profile may be complete, or name a ``"base"`` profile and give only what was measured
(``autosp-profile`` writes the latter): its fields replace the base's.

    {"format": "autosp-hardware/1", "name": "my-node", "base": "h100-80gb",
     "matmul_flops": {"bfloat16": 7.1e14},
     "comm": {"all_to_all": {"latency": 3e-05, "bandwidth": 3.4e11, "world": 8,
                             "points": [[1048576, 4.1e-05], ...]}}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from autosp.errors import ConfigError
from autosp.hardware import COLLECTIVES, AttentionKernel, CommModel, HardwareProfile, Interconnect

FORMAT = "autosp-hardware/1"

# Names that other spellings (and older releases) use for the built-ins.
ALIASES = {
    "h100": "h100-80gb",
    "cuda-h100": "h100-80gb",
    "a100": "a100-80gb",
    "cuda-a100": "a100-80gb",
    "cuda-h200": "h200",
    "h200-141gb": "h200",
    "b200-180gb": "b200",
}


def known_profiles() -> dict[str, HardwareProfile]:
    """Every profile by name: core's built-ins, then those plugins registered."""
    from autosp.hardware_builtin import BUILTIN_PROFILES
    from autosp.registry import get_registry

    table = {p.name: p for p in BUILTIN_PROFILES}
    table.update(get_registry().hardware)
    return table


def find_named(name: str) -> HardwareProfile:
    table = known_profiles()
    key = ALIASES.get(name.lower(), name.lower())
    if key in table:
        return table[key]
    hint = "" if "mi" not in key else " (AMD Instinct profiles come with autosp-rocm: pip install autosp-rocm)"
    raise ConfigError(
        f"no hardware profile named {name!r}{hint}; known: {', '.join(sorted(table))}; "
        "or give the path of a JSON profile (autosp-profile writes one)"
    )


def _kernel(d: dict[str, Any]) -> AttentionKernel:
    return AttentionKernel(**{**d, "dtypes": tuple(d.get("dtypes", AttentionKernel.dtypes))})


def _comm(d: dict[str, Any]) -> CommModel:
    return CommModel(
        float(d["latency"]),
        float(d["bandwidth"]),
        tuple((float(b), float(t)) for b, t in d.get("points", ())),
        int(d.get("world", 2)),
    )


def _interconnect(d: dict[str, Any]) -> Interconnect:
    d = dict(d)
    d["peer_bandwidth"] = tuple(tuple(float(x) for x in row) for row in d.get("peer_bandwidth", ()))
    return Interconnect(**d)


def from_dict(d: dict[str, Any], where: str = "profile") -> HardwareProfile:
    """A profile from its JSON form; unknown keys and a wrong format are errors that say what is allowed."""
    d = dict(d)
    fmt = d.pop("format", FORMAT)
    if fmt != FORMAT:
        raise ConfigError(f"{where}: format {fmt!r} is not {FORMAT!r}; re-create it with autosp-profile")
    base_name = d.pop("base", None)
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = set(d) - fields
    if unknown:
        raise ConfigError(
            f"{where}: unknown keys {sorted(unknown)}; allowed: base, format, {', '.join(sorted(fields))}"
        )
    if "interconnect" in d and d["interconnect"] is not None:
        d["interconnect"] = _interconnect(d["interconnect"])
    if "comm" in d:
        bad = set(d["comm"]) - set(COLLECTIVES)
        if bad:
            raise ConfigError(f"{where}: comm has {sorted(bad)}; use {', '.join(COLLECTIVES)}")
        d["comm"] = {k: _comm(v) for k, v in d["comm"].items()}
    if "attention_kernels" in d:
        d["attention_kernels"] = tuple(_kernel(k) for k in d["attention_kernels"])
    if "match" in d and isinstance(d["match"], list):
        d["match"] = tuple(d["match"])
    try:
        if base_name is None:
            return HardwareProfile(**d)
        base = find_named(base_name)
        merged = dict(base.matmul_flops)
        merged.update(d.pop("matmul_flops", {}))
        attention = dict(base.attention_flops)
        attention.update(d.pop("attention_flops", {}))
        kernels = dict(base.kernel_flops)
        kernels.update(d.pop("kernel_flops", {}))
        comm = dict(base.comm)
        comm.update(d.pop("comm", {}))
        # flops/comm_bandwidth are derived: recompute them from the merged figures.
        return dataclasses.replace(
            base,
            **{"flops": 0.0, "comm_bandwidth": 0.0, **d},
            matmul_flops=merged,
            attention_flops=attention,
            kernel_flops=kernels,
            comm=comm,
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def to_dict(p: HardwareProfile) -> dict[str, Any]:
    """The JSON form of a complete profile."""
    d = dataclasses.asdict(p)
    d["match"] = list(p.match)
    d["comm"] = {k: {**dataclasses.asdict(v), "points": [list(x) for x in v.points]} for k, v in p.comm.items()}
    return {"format": FORMAT, **d}


def load(path_or_name: str | os.PathLike[str] | HardwareProfile) -> HardwareProfile:
    if isinstance(path_or_name, HardwareProfile):
        return path_or_name
    text = os.fspath(path_or_name)
    path = Path(text).expanduser()
    if text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(
                f"hardware profile file {text} does not exist; create it with autosp-profile --out {text}"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"hardware profile {text} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"hardware profile {text} must hold a JSON object")
        return from_dict(data, where=str(path))
    return find_named(text)


def save(profile: HardwareProfile | dict[str, Any], path: str | os.PathLike[str]) -> None:
    data = to_dict(profile) if isinstance(profile, HardwareProfile) else profile
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


__all__ = ["ALIASES", "FORMAT", "find_named", "from_dict", "known_profiles", "load", "save", "to_dict"]
