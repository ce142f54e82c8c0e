"""``mode=`` and ``options=`` (torch.compile's Inductor config) given to AutoSP: applied, or refused clearly."""

from __future__ import annotations

import copy

import pytest
import torch
from _core_helpers import TinyAttention
from torch.testing import assert_close

import autosp
from autosp import ConfigError
from autosp.inductor_options import inductor_config


def test_modes_become_inductor_config_without_cuda_graphs():
    assert inductor_config("inductor", None, None, False) == {}
    assert inductor_config("inductor", "default", None, False) == {}
    assert inductor_config("inductor", "max-autotune-no-cudagraphs", {"epilogue_fusion": False}, False) == {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "epilogue_fusion": False,
    }
    with pytest.warns(UserWarning, match="leaves out CUDA graphs"):
        config = inductor_config("inductor", "max-autotune", None, False)
    assert config == {"max_autotune": True, "coordinate_descent_tuning": True}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"backend": "aot_eager", "mode": "max-autotune"}, "backend='aot_eager' runs no Inductor"),
        ({"backend": "aot_eager", "options": {"epilogue_fusion": False}}, "runs no Inductor"),
        ({"mode": "reduce-overhead"}, "CUDA graphs .* are not supported"),
        ({"options": {"triton.cudagraphs": True}}, "CUDA graphs .* are not supported"),
        ({"mode": "fastest"}, "mode='fastest'"),
    ],
)
def test_refused_when_compiled_before_anything_runs(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        autosp.compile(TinyAttention(), sp_size=1, **kwargs)


def test_options_reach_inductor_and_the_result_is_exact(monkeypatch):
    # Once a TypeError from inside Dynamo: torch.compile hands mode= and options= to the backend.
    from torch._inductor import compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(*args, **kwargs):
        seen.append(kwargs.get("config_patches", {}))
        return real(*args, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.manual_seed(0)
    eager = TinyAttention()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 8, 16)
    compiled = torch.compile(model, backend=autosp.backend(sp_size=1), options={"epilogue_fusion": False})
    out = compiled(x)
    out.square().mean().backward()
    ref = eager(x)
    ref.square().mean().backward()
    # compile_fx applies its patches, then calls itself without them.
    assert seen and seen[0]["epilogue_fusion"] is False and "custom_partitioner_fn" in seen[0], seen
    assert_close(out, ref)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, msg=name)
