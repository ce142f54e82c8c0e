"""Pass ordering and the pass manager: order, cycles, disabling, timing, dumps, type checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autosp import AutoSPError, ConfigError, Pass, Stage
from autosp.passes.core import PASSES
from autosp.passes.manager import DEBUG_DIR_ENV, DISABLE_ENV, PassManager, PassRecord, order_passes


def _noop(gm, ctx):
    return None


def P(name, stage=Stage.GRAPH, fn=_noop, **kw):  # noqa: N802 - short factory
    return Pass(name, stage, fn, **kw)


def names(passes):
    return [p.name for p in passes]


def _gm() -> torch.fx.GraphModule:
    class M(torch.nn.Module):
        def forward(self, x):
            return (x + 1).relu() * 2

    return torch.fx.symbolic_trace(M())


CTX = SimpleNamespace(rank=0, graph_id=7)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(DEBUG_DIR_ENV, raising=False)


# --- ordering ---------------------------------------------------------------------------------


def test_no_constraints_keeps_registration_order():
    assert names(order_passes([P("c"), P("a"), P("b")])) == ["c", "a", "b"]


def test_requires_after_before():
    passes = [
        P("shard", requires=("lower",)),
        P("lower", requires=("find",)),
        P("cleanup", after=("shard", "not-installed")),  # soft: absent passes are ignored
        P("find"),
        P("plugin", requires=("lower",), before=("shard", "absent-too")),
    ]
    order = names(order_passes(passes))
    assert sorted(order) == sorted(names(passes))
    pos = {n: i for i, n in enumerate(order)}
    assert pos["find"] < pos["lower"] < pos["plugin"] < pos["shard"] < pos["cleanup"]


def test_before_alone_moves_a_pass_earlier():
    order = names(order_passes([P("a"), P("b"), P("early", before=("a",))]))
    assert order.index("early") < order.index("a")


def test_core_and_ulysses_passes_order():
    from autosp.passes.unrepeat import UNREPEAT_KV

    order = names(order_passes([*PASSES, UNREPEAT_KV]))
    assert order.index("autosp.find_attention") < order.index("autosp.lower") < order.index("autosp.unrepeat_kv")
    assert order.index("autosp.unrepeat_kv") < order.index("autosp.shard")


def test_cycle_is_named():
    with pytest.raises(ConfigError, match="cycle") as err:
        order_passes([P("x"), P("a", requires=("b",)), P("b", after=("c",)), P("c", requires=("a",))])
    msg = str(err.value)
    # The cycle is spelled out, start and end being the same pass.
    cycle = msg.split("cycle: ")[1].split(";")[0].split(" -> ")
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"} and len(cycle) == 4
    assert "x" not in cycle


def test_cycle_through_before():
    with pytest.raises(ConfigError, match=r"cycle: (a -> b -> a|b -> a -> b)"):
        order_passes([P("a", before=("b",)), P("b", before=("a",))])


def test_self_cycle():
    with pytest.raises(ConfigError, match="cycle: a -> a"):
        order_passes([P("a", after=("a",))])


def test_missing_required_pass():
    with pytest.raises(ConfigError) as err:
        order_passes([P("b", requires=("a",))])
    msg = str(err.value)
    assert "'b' requires pass 'a'" in msg and "not registered or was disabled" in msg


# --- disabling ----------------------------------------------------------------------------------


def test_disable_by_argument():
    pm = PassManager([P("a"), P("b"), P("c")], disabled=["b"])
    assert names(pm.passes) == ["a", "c"]


def test_disable_by_env(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, " a , c,")
    pm = PassManager([P("a"), P("b"), P("c")], disabled=())
    assert names(pm.passes) == ["b"]
    assert pm.disabled == {"a", "c"}


def test_disable_unknown_name_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"cannot disable unknown passes \['nope'\].*known passes: \['a', 'b'\]"):
        PassManager([P("a"), P("b")], disabled=["nope"])
    monkeypatch.setenv(DISABLE_ENV, "typo")
    with pytest.raises(ConfigError, match="typo"):
        PassManager([P("a"), P("b")])


def test_disabling_a_required_pass_errors():
    with pytest.raises(ConfigError, match="'autosp.(shard|unrepeat_kv)' requires pass 'autosp.lower'.*disabled"):
        PassManager(list(PASSES), disabled=["autosp.lower"])


# --- running ----------------------------------------------------------------------------------------


def test_run_by_stage_with_records():
    calls = []

    def grow(gm, ctx):
        calls.append("grow")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            gm.graph.call_function(torch.add, (out.args[0], 1))  # dead node: +1 node
        gm.recompile()

    def replace(gm, ctx):
        calls.append("replace")
        return _gm()

    passes = [
        P("replace", fn=replace, after=("grow",)),
        P("grow", fn=grow),
        P("skipped", applies=lambda ctx: False, fn=lambda gm, ctx: calls.append("skipped")),
        P("fwd", stage=Stage.FORWARD, fn=lambda gm, ctx: calls.append("fwd")),
    ]
    pm = PassManager(passes)
    gm = _gm()
    n = len(gm.graph.nodes)
    out = pm.run(Stage.GRAPH, gm, CTX)
    assert calls == ["grow", "replace"]
    assert isinstance(out, torch.fx.GraphModule) and out is not gm
    assert [(r.name, r.stage, r.nodes_before, r.nodes_after) for r in pm.records] == [
        ("grow", "graph", n, n + 1),
        ("replace", "graph", n + 1, n),
    ]
    assert all(isinstance(r, PassRecord) and r.seconds >= 0 for r in pm.records)
    pm.run(Stage.FORWARD, out, CTX)
    assert calls[-1] == "fwd" and pm.records[-1].stage == "forward"
    assert torch.equal(out(torch.ones(2)), torch.full((2,), 4.0))


def test_pass_returning_non_graphmodule_raises():
    pm = PassManager([P("bad", fn=lambda gm, ctx: "oops")])
    with pytest.raises(TypeError, match="pass bad returned str, not a GraphModule"):
        pm.run(Stage.GRAPH, _gm(), CTX)


def _with_fake_constant(name: str, fake: torch.Tensor):
    def leak(gm, ctx):
        gm.register_buffer(name, fake)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            gm.graph.get_attr(name)
        gm.recompile()

    return leak


def test_a_pass_that_leaves_a_fake_tensor_in_the_program_is_named():
    # What an op run on a node's meta value while tracing leaves: a fake constant the compiled
    # program would take as an input every call (Inductor on CUDA reads its data pointer).
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.ones(3))
    pm = PassManager([P("ok"), P("leaky", fn=_with_fake_constant("_tensor_constant0", fake), after=("ok",))])
    with pytest.raises(AutoSPError, match=r"internal: pass leaky left fake tensors in the program: _tensor_constant0"):
        pm.run(Stage.GRAPH, _gm(), CTX)
    # A fake constant the program held before (compiled on fake parameters, as autosp-plan does) is not a leak.
    gm = _gm()
    gm.register_buffer("held", fake)
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        gm.graph.get_attr("held")
    PassManager([P("ok")]).run(Stage.GRAPH, gm, CTX)


def test_debug_dir_dumps_before_and_after(tmp_path, monkeypatch):
    monkeypatch.setenv(DEBUG_DIR_ENV, str(tmp_path))
    pm = PassManager([P("first"), P("second", stage=Stage.GRAPH, after=("first",))])
    pm.run(Stage.GRAPH, _gm(), CTX)
    folder = tmp_path / "rank0" / "graph7"
    assert sorted(p.name for p in folder.iterdir()) == [
        "graph.first.after.py",
        "graph.first.before.py",
        "graph.second.after.py",
        "graph.second.before.py",
    ]
    assert "relu" in (folder / "graph.first.before.py").read_text()


def test_no_dumps_without_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    PassManager([P("a")]).run(Stage.GRAPH, _gm(), CTX)
    assert list(tmp_path.iterdir()) == []


def test_compile_honours_disable_and_debug_dir(tmp_path, monkeypatch):
    """Through ``autosp.compile``: a disabled pass leaves no record; dumps land per rank and graph."""
    from _core_helpers import TinyAttention

    import autosp

    monkeypatch.setenv(DEBUG_DIR_ENV, str(tmp_path))
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 4, 16)
    # SAC and loss tiling are off so that only these core passes run, whichever plugins are installed.
    compiled = autosp.compile(
        model, sp_size=1, backend="aot_eager", sac=False, tile_loss=False, disable_passes=("autosp.dce_backward",)
    )
    compiled(x).sum().backward()
    (report,) = compiled.autosp_reports
    assert [(r.stage, r.name) for r in report.passes] == [
        ("graph", "autosp.find_attention"),
        ("forward", "autosp.dce_forward"),
    ]
    dumps = sorted(p.name for p in tmp_path.glob("rank0/graph*/*.py"))
    assert dumps == [
        "forward.autosp.dce_forward.after.py",
        "forward.autosp.dce_forward.before.py",
        "graph.autosp.find_attention.after.py",
        "graph.autosp.find_attention.before.py",
    ]
