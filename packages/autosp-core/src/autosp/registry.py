"""The plugin registry: pluggy over the ``autosp`` entry-point group, loaded on first use.

Environment:
    AUTOSP_BLOCK_PLUGINS: comma-separated plugin (entry-point) names not to load.
    AUTOSP_TRACE_HOOKS: when set, every hook call and result is written to stderr.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from autosp import hookspecs
from autosp.analysis.attention import AttentionSpec
from autosp.errors import ConfigError
from autosp.hardware import HardwareProfile
from autosp.passes.manager import Pass
from autosp.variants import KNOWN_PACKAGES, SPVariant

ENTRY_POINT_GROUP = "autosp"
BLOCK_ENV = "AUTOSP_BLOCK_PLUGINS"
TRACE_ENV = "AUTOSP_TRACE_HOOKS"
SAC_PREFIX = "sac."  # the names of autosp-sac's passes


@dataclass
class Registry:
    """Everything the loaded plugins registered."""

    manager: pluggy.PluginManager
    passes: dict[str, Pass] = field(default_factory=dict)
    variants: dict[str, SPVariant] = field(default_factory=dict)
    attention: dict[str, AttentionSpec] = field(default_factory=dict)
    hardware: dict[str, HardwareProfile] = field(default_factory=dict)
    sharding_rules: dict[Any, Callable[..., Any]] = field(default_factory=dict)

    def variant(self, name: str) -> SPVariant:
        if name in self.variants:
            return self.variants[name]
        if name == "auto":
            from autosp.passes.choose_variant import AUTO_VARIANT, PREFERENCE

            if any(n in self.variants for n in PREFERENCE):
                return AUTO_VARIANT
            raise ConfigError(
                "variant='auto' chooses among the installed variants, and none of ulysses, ring, hybrid is "
                "installed: pip install autosp-ulysses (and autosp-ring)"
            )
        package = KNOWN_PACKAGES.get(name)
        if package:
            raise ConfigError(f"SP variant {name!r} is provided by the {package} package, {self._absent(package)}")
        known = sorted(self.variants) or ["none installed"]
        raise ConfigError(f"unknown SP variant {name!r}; installed variants: {', '.join(known)}")

    def require_sac(self, sac: object) -> None:
        """``sac=True`` asks for the checkpointing passes: without them it would silently compile without SAC."""
        if sac is True and not any(name.startswith(SAC_PREFIX) for name in self.passes):
            raise ConfigError(f"sac=True needs the autosp-sac package, {self._absent('autosp-sac')}")

    def _absent(self, package: str) -> str:
        if self.manager.is_blocked(package):
            return f"which is blocked by {BLOCK_ENV}: remove {package!r} from it"
        return f"which is not installed: pip install {package}"

    def plugin_names(self) -> list[str]:
        # pluggy keeps blocked names mapped to None.
        return sorted(name for name, plugin in self.manager.list_name_plugin() if plugin is not None)


def _adder(kind: str, table: dict[str, Any]) -> Callable[[Any], None]:
    def register(item: Any) -> None:
        if item.name in table:
            raise ConfigError(f"two plugins register the {kind} {item.name!r}; block one with {BLOCK_ENV}")
        table[item.name] = item

    return register


def _rule_adder(table: dict[Any, Callable[..., Any]]) -> Callable[..., None]:
    from autosp.sharding.rules.base import declare

    def register(op: Any, rule: Callable[..., Any], *, accepts: Iterable[type] = ()) -> None:
        if op in table:
            raise ConfigError(
                f"two plugins register a sharding rule for {op}; block one with {BLOCK_ENV} "
                "(core's own rules cannot be replaced)"
            )
        table[op] = declare(rule, accepts) if accepts else rule

    return register


def build_registry(extra_plugins: tuple[Any, ...] = ()) -> Registry:
    """Load plugins from entry points (and ``extra_plugins``) and collect their registrations."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in os.environ.get(BLOCK_ENV, "").split(","):
        if name.strip():
            pm.set_blocked(name.strip())
    if os.environ.get(TRACE_ENV):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    reg = Registry(pm)
    pm.hook.autosp_register_passes(register=_adder("pass", reg.passes))
    pm.hook.autosp_register_variants(register=_adder("variant", reg.variants))
    pm.hook.autosp_register_attention(register=_adder("attention op", reg.attention))
    pm.hook.autosp_register_hardware(register=_adder("hardware profile", reg.hardware))
    pm.hook.autosp_register_sharding_rules(register=_rule_adder(reg.sharding_rules))
    return reg


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry()
        return _registry


def reset_registry() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin at run time)."""
    global _registry
    with _lock:
        _registry = None


__all__ = [
    "BLOCK_ENV",
    "ENTRY_POINT_GROUP",
    "TRACE_ENV",
    "Registry",
    "build_registry",
    "get_registry",
    "reset_registry",
]
