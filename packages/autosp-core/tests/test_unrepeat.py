"""The ``autosp.unrepeat_kv`` pass on lowered graphs: k/v exchanged before the model repeats them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "integration_tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "integration_tests"))

from autosp import SPOptions  # noqa: E402
from autosp.compiler import make_context  # noqa: E402
from autosp.lowering import SDPA  # noqa: E402
from autosp.passes.core import lower  # noqa: E402
from autosp.passes.unrepeat import UNREPEAT_KV, find_repeat_base, unrepeat_kv  # noqa: E402
from autosp.registry import get_registry  # noqa: E402


def _lower_and_unrepeat(model, *inputs):
    """Inside a Dynamo backend: lower the graph as autosp.lower does, then run the pass on it."""
    out = {}

    def backend(gm, example_inputs):
        ctx = make_context(gm, example_inputs, SPOptions(sp_size=1), get_registry(), None, 1)
        low = lower(gm, ctx)
        leaves = [n for n in low.graph.nodes if n.target == SDPA.leaf]
        out["kv_before"] = [tuple(n.args[1].meta["val"].shape) for n in leaves]
        out["heads_before"] = [s.kv_heads for s in ctx.sites]
        out["expected"] = low(*example_inputs)
        unrepeat_kv(low, ctx)
        leaves = [n for n in low.graph.nodes if n.target == SDPA.leaf]
        out["kv_after"] = [tuple(n.args[1].meta["val"].shape) for n in leaves]
        out["gqa"] = [n.kwargs.get("enable_gqa", n.args[7] if len(n.args) > 7 else False) for n in leaves]
        out["heads_after"] = [s.kv_heads for s in ctx.sites]
        out["notes"] = list(ctx.report.notes)
        out["got"] = low(*example_inputs)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    return out


def test_llama_repeat_kv_is_undone():
    from autosp.testing.models import Config, LlamaLike

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 8))
    r = _lower_and_unrepeat(LlamaLike(Config(heads=4, kv_heads=2, layers=2)), ids, ids)
    assert r["kv_before"] == [(2, 4, 8, 16)] * 2 and r["heads_before"] == [4, 4]
    assert r["kv_after"] == [(2, 2, 8, 16)] * 2 and r["heads_after"] == [2, 2]
    assert r["gqa"] == [True, True]
    assert r["notes"] == ["autosp.unrepeat_kv: 2 attention site(s) exchange k/v before repeat"]
    assert_close(r["got"], r["expected"])  # same attention, computed with enable_gqa


def test_no_repeat_no_change():
    from autosp.testing.models import Config, GPT2Like

    ids = torch.randint(0, 96, (1, 8))
    r = _lower_and_unrepeat(GPT2Like(Config(layers=1)), ids, ids)
    assert r["kv_before"] == r["kv_after"] == [(1, 4, 8, 16)]
    assert r["gqa"] == [False] and r["notes"] == []


def test_find_repeat_base_rejects_non_nodes():
    assert find_repeat_base(None) is None
    assert find_repeat_base(3) is None


@pytest.mark.parametrize(
    ("sp", "variant", "applies"), [(True, "ulysses", True), (False, "ulysses", False), (True, "ring", True)]
)
def test_applies_to_every_variant_under_sp(sp, variant, applies):
    ctx = SimpleNamespace(sp=sp, options=SimpleNamespace(variant=variant))
    assert UNREPEAT_KV.applies(ctx) is applies
    assert UNREPEAT_KV.requires == ("autosp.lower",) and UNREPEAT_KV.before == ("autosp.shard",)
