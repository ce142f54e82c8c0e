"""Plugin discovery through real ``autosp`` entry points, blocking, tracing and validation."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest
import torch

import autosp
from autosp import ConfigError, hookimpl
from autosp.registry import BLOCK_ENV, TRACE_ENV, build_registry, get_registry, reset_registry

PLUGIN_SRC = '''
"""A third-party AutoSP plugin, as someone would publish it."""
import torch
import torch.nn.functional as F

from autosp import AttentionSpec, HardwareProfile, Pass, SPVariant, Stage, hookimpl

CALLS = []


@torch.library.custom_op("autosp_testplugin::toy_attn", mutates_args=())
def toy_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


@toy_attn.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _mark(gm, ctx):
    CALLS.append(len(ctx.sites))


def _rule(ctx, node, site, args, kwargs):
    raise NotImplementedError


TOY_PASS = Pass("testplugin.mark", Stage.GRAPH, _mark, after=("autosp.find_attention",), doc="records sites")
TOY_VARIANT = SPVariant("toy", attention_rule=_rule, doc="a toy variant")
TOY_ATTENTION = AttentionSpec("toy_attn", targets=(torch.ops.autosp_testplugin.toy_attn.default,), layout="BHSD")
TOY_HARDWARE = HardwareProfile("toy-npu", "toy", flops=1.0, comm_bandwidth=2.0)


@hookimpl
def autosp_register_passes(register):
    register(TOY_PASS)


@hookimpl
def autosp_register_variants(register):
    register(TOY_VARIANT)


@hookimpl
def autosp_register_attention(register):
    register(TOY_ATTENTION)


@hookimpl
def autosp_register_hardware(register):
    register(TOY_HARDWARE)
'''

BAD_PLUGIN_SRC = """
from autosp import hookimpl


@hookimpl
def autosp_register_pases(register):  # misspelt hook name
    pass
"""


def _make_dist(root: Path, dist: str, module: str, source: str) -> Path:
    project = root / dist
    (project / "src" / module).mkdir(parents=True)
    (project / "src" / module / "__init__.py").write_text(source)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f'''
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [project.entry-points.autosp]
        {dist} = "{module}"

        [tool.hatch.build.targets.wheel]
        packages = ["src/{module}"]
    ''')
    )
    return project


@pytest.fixture(scope="module")
def plugin_sites(tmp_path_factory) -> dict[str, Path]:
    """Two plugin distributions, each pip-installed into its own target folder."""
    root = tmp_path_factory.mktemp("plugins")
    sites = {}
    for dist, module, source in (
        ("autosp-testplugin", "autosp_testplugin", PLUGIN_SRC),
        ("autosp-badplugin", "autosp_badplugin", BAD_PLUGIN_SRC),
    ):
        project = _make_dist(root, dist, module, source)
        site = root / f"site-{module}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--disable-pip-version-check",
                "--no-index",
                "--target",
                str(site),
                str(project),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        assert list(site.glob(f"{module.replace('-', '_')}-*.dist-info/entry_points.txt"))
        sites[module] = site
    return sites


@pytest.fixture
def on_path(monkeypatch, fresh_registry):
    """Put a plugin's site folder on sys.path for one test; sys.path and the registry are restored after."""

    def add(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))  # also invalidates import caches
        importlib.invalidate_caches()
        reset_registry()

    yield add
    reset_registry()


# --- first-party plugins ---------------------------------------------------------------------------


def test_first_party_plugins_come_from_entry_points(fresh_registry):
    reg = get_registry()
    assert {"autosp-core", "autosp-ulysses"} <= set(reg.plugin_names())
    assert {
        "autosp.find_attention",
        "autosp.lower",
        "autosp.shard",
        "autosp.sync_grads",
        "autosp.dce_forward",
        "autosp.dce_backward",
        "autosp.unrepeat_kv",
    } <= set(reg.passes)
    assert {"ulysses"} <= set(reg.variants) and "toy" not in reg.variants
    assert {"cpu", "cuda", "h100-80gb"} <= set(reg.hardware)
    assert get_registry() is reg  # built once
    reset_registry()
    assert get_registry() is not reg


def test_block_first_party_plugin(fresh_registry, monkeypatch):
    monkeypatch.setenv(BLOCK_ENV, "autosp-ulysses, nothing-such")
    reg = get_registry()
    assert reg.manager.is_blocked("autosp-ulysses") and reg.manager.get_plugin("autosp-ulysses") is None
    assert reg.manager.get_plugin("autosp-core") is not None
    assert "ulysses" not in reg.variants
    with pytest.raises(ConfigError, match=r"provided by the autosp-ulysses package, which is blocked by AUTOSP_BLOCK"):
        reg.variant("ulysses")


def test_plugin_names_omit_blocked(fresh_registry, monkeypatch):
    monkeypatch.setenv(BLOCK_ENV, "autosp-ulysses,nothing-such")
    names = get_registry().plugin_names()
    assert "autosp-core" in names
    assert "autosp-ulysses" not in names and "nothing-such" not in names


def test_duplicate_registration_is_an_error(fresh_registry):
    class Clash:
        @hookimpl
        def autosp_register_variants(self, register):
            register(autosp.SPVariant("ulysses", attention_rule=lambda *a: None))

    with pytest.raises(ConfigError, match=r"two plugins register the variant 'ulysses'.*AUTOSP_BLOCK_PLUGINS"):
        build_registry(extra_plugins=(Clash(),))


def test_core_rules_come_through_the_hook(fresh_registry):
    from autosp.sharding.rules import RULES

    rules = get_registry().sharding_rules
    assert rules.keys() == RULES.keys()
    assert rules[torch.ops.aten.mm.default] is RULES[torch.ops.aten.mm.default]


def test_plugin_sharding_rule_is_used_with_its_contract(fresh_registry):
    from autosp.sharding import Partial, accepted

    def my_rule(ctx, node, args, kwargs):
        raise AssertionError("not called here")

    class Rules:
        @hookimpl
        def autosp_register_sharding_rules(self, register):
            register(torch.ops.aten.bucketize.Tensor, my_rule, accepts=(Partial,))

    reg = build_registry(extra_plugins=(Rules(),))
    assert reg.sharding_rules[torch.ops.aten.bucketize.Tensor] is my_rule
    assert accepted(my_rule) == {Partial}


def test_replacing_a_core_rule_is_an_error(fresh_registry):
    class Clash:
        @hookimpl
        def autosp_register_sharding_rules(self, register):
            register(torch.ops.aten.mm.default, lambda *a: None)

    with pytest.raises(ConfigError, match=r"two plugins register a sharding rule for aten.mm.default.*core's own"):
        build_registry(extra_plugins=(Clash(),))


# --- a third-party plugin, installed for real --------------------------------------------------------


def test_installed_plugin_is_discovered(plugin_sites, on_path):
    on_path(plugin_sites["autosp_testplugin"])
    reg = get_registry()
    assert {"autosp-core", "autosp-ulysses", "autosp-testplugin"} <= set(reg.plugin_names())
    assert reg.passes["testplugin.mark"].after == ("autosp.find_attention",)
    assert reg.variant("toy").doc == "a toy variant"
    assert {"ulysses", "toy"} <= set(reg.variants)
    assert reg.attention["toy_attn"].targets == (torch.ops.autosp_testplugin.toy_attn.default,)
    assert reg.hardware["toy-npu"].flops == 1.0
    mod = sys.modules["autosp_testplugin"]
    assert Path(mod.__file__).is_relative_to(plugin_sites["autosp_testplugin"])

    # Its pass runs in a compile, after find_attention, which finds its attention op.
    class UsesToy(torch.nn.Module):
        def forward(self, x):
            return mod.toy_attn(x, x, x).sum()

    del mod.CALLS[:]
    x = torch.randn(1, 2, 4, 8)
    text = autosp.explain(UsesToy(), x, sp_size=1)
    assert "[toy_attn] B=1 H=2 S=4 D=8" in text
    assert "testplugin.mark" in text
    assert mod.CALLS == [1]


def test_block_installed_plugin(plugin_sites, on_path, monkeypatch):
    monkeypatch.setenv(BLOCK_ENV, "autosp-testplugin,autosp-ring")
    on_path(plugin_sites["autosp_testplugin"])
    reg = get_registry()
    assert reg.manager.get_plugin("autosp-testplugin") is None
    assert {"autosp-core", "autosp-ulysses"} <= set(reg.plugin_names())
    assert "testplugin.mark" not in reg.passes and "toy" not in reg.variants
    assert "toy_attn" not in reg.attention and "toy-npu" not in reg.hardware
    with pytest.raises(ConfigError, match=r"unknown SP variant 'toy'; installed variants: ulysses"):
        reg.variant("toy")


def test_trace_hooks(plugin_sites, on_path, monkeypatch, capsys):
    on_path(plugin_sites["autosp_testplugin"])
    get_registry()
    assert capsys.readouterr().err == ""
    reset_registry()
    monkeypatch.setenv(TRACE_ENV, "1")
    get_registry()
    err = capsys.readouterr().err
    for hook in (
        "autosp_register_passes",
        "autosp_register_variants",
        "autosp_register_attention",
        "autosp_register_hardware",
    ):
        assert hook in err
    assert "finish autosp_register_variants" in err


def test_misspelt_hook_is_rejected(plugin_sites, on_path):
    on_path(plugin_sites["autosp_badplugin"])
    with pytest.raises(pluggy.PluginValidationError, match="autosp_register_pases"):
        get_registry()


def test_misspelt_hook_plugin_can_be_blocked(plugin_sites, on_path, monkeypatch):
    monkeypatch.setenv(BLOCK_ENV, "autosp-badplugin")
    on_path(plugin_sites["autosp_badplugin"])
    assert get_registry().manager.get_plugin("autosp-badplugin") is None


def test_plugin_gone_after_cleanup(fresh_registry):
    """Runs after the plugin tests: sys.path was restored, so only first-party plugins load."""
    assert not any("site-autosp_" in p for p in sys.path)
    names = get_registry().plugin_names()
    assert "autosp-testplugin" not in names and "autosp-badplugin" not in names
