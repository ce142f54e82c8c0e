"""Bad input gives a clear error that says what to do, before any collective runs."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _core_helpers import TinyAttention

import autosp
from autosp import AutoSPError, ConfigError, SPOptions
from autosp.registry import BLOCK_ENV, get_registry

# --- one process, no process group -------------------------------------------------------------------


def test_a_vmap_beside_flex_attention_is_refused_before_lowering(monkeypatch):
    # A vmap is lowered in two traces (test_lowering_vmap.py), which Flex's higher-order op does not
    # survive: in a graph with a flex_attention call it is refused, naming the vmap's line.
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from autosp.compiler import make_context
    from autosp.passes.core import find_attention

    monkeypatch.setattr("autosp.compiler.dist.get_rank", lambda group=None: 0)

    def backend(gm, example_inputs):
        find_attention(gm, make_context(gm, example_inputs, SPOptions(), get_registry(), None, 2))
        return gm.forward

    mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 16, 16, device="cpu", BLOCK_SIZE=8)

    def program(q):
        q = torch.func.vmap(lambda row: row.softmax(-1))(q)  # the line the message must name
        return flex_attention(q, q, q, block_mask=mask).sum()

    def vmap_alone(x):
        return torch.func.vmap(lambda row: row.softmax(-1))(x).sum()

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(AutoSPError, match=r"torch.func.vmap in a graph that also calls flex") as err:
        torch.compile(program, backend=backend, fullgraph=True)(torch.randn(1, 2, 16, 8))
    # A vmap of the user's own is not told about block masks; one alone passes the check.
    assert "torch.compiler.disable" in str(err.value) and "block mask" not in str(err.value), err.value
    assert "test_errors.py" in str(err.value)
    torch._dynamo.reset()
    torch.compile(vmap_alone, backend=backend, fullgraph=True)(torch.randn(2, 8))
    torch._dynamo.reset()


def test_refusal_names_the_users_line_not_torchs(monkeypatch):
    # flex_attention without a block mask builds one inside the graph (vmap): refused, and the message
    # must point at the model's call, not at torch's flex_attention wrapper.
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from autosp.compiler import make_context
    from autosp.passes.core import find_attention

    monkeypatch.setattr("autosp.compiler.dist.get_rank", lambda group=None: 0)

    def backend(gm, example_inputs):
        find_attention(gm, make_context(gm, example_inputs, SPOptions(), get_registry(), None, 2))
        return gm.forward

    def program(q):
        return flex_attention(q, q, q).sum()  # the line the message must name

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(AutoSPError, match=r"vmap .*FlexAttention's block mask.*outside") as err:
        torch.compile(program, backend=backend, fullgraph=True)(torch.randn(1, 2, 16, 8))
    torch._dynamo.reset()
    assert "test_errors.py" in str(err.value) and "flex_attention.py" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"backend": "tvm"}, r"backend='tvm' is not one of \('inductor', 'aot_eager', 'eager'\)"),
        ({"sac": "sometimes"}, r"sac='sometimes'; use 'auto', True or False"),
        ({"sp_size": 0}, r"sp_size=0; it must be a positive int or None"),
        ({"sp_size": "2"}, r"sp_size='2'; it must be a positive int"),
        ({"outputs": "dtensor"}, r"outputs='dtensor'; use 'whole' \(the default\) or 'sharded' \(DTensors\)"),
    ],
)
def test_bad_options(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        autosp.compile(TinyAttention(), **kwargs)
    with pytest.raises(ConfigError, match=pattern):
        SPOptions(**kwargs)


def test_sp_size_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"sp_size=2 needs an initialized process group.*init_process_group"):
        autosp.compile(TinyAttention(), sp_size=2)
    with pytest.raises(ConfigError, match=r"sp_size=2 needs an initialized process group"):
        autosp.backend(sp_size=2)


def test_deepcopy_of_a_compiled_model_says_what_to_copy():
    import copy

    compiled = autosp.compile(TinyAttention(), sp_size=1, backend="eager")
    with pytest.raises(ConfigError, match=r"deepcopy.*not supported.*copy.deepcopy\(compiled._orig_mod\)"):
        copy.deepcopy(compiled)
    copy.deepcopy(compiled._orig_mod)  # the model itself copies


def test_a_compiled_model_is_not_saved_but_its_model_is():
    import copy
    import io
    import pickle

    import torch

    model = TinyAttention()
    compiled = autosp.compile(model, sp_size=1, backend="eager")
    compiled(torch.randn(2, 8, 16))
    assert len(compiled.autosp_reports) == 1
    for save in (lambda: torch.save(compiled, io.BytesIO()), lambda: pickle.dumps(compiled)):
        with pytest.raises(ConfigError, match=r"cannot be saved or pickled.*compiled\._orig_mod.*state_dict"):
            save()
    # The reports (graphs, nodes) stay on the compiled module: the model saves and copies as it did.
    assert "autosp_reports" not in vars(model)
    torch.save(model, io.BytesIO())
    copy.deepcopy(model)


def test_unknown_and_uninstalled_variants(fresh_registry, monkeypatch):
    from autosp.registry import reset_registry

    # Whether or not autosp-ring is installed here, a blocked one is named as blocked.
    monkeypatch.setenv(BLOCK_ENV, "autosp-ring")
    reset_registry()
    reg = get_registry()
    with pytest.raises(ConfigError, match=r"unknown SP variant 'nope'; installed variants: ulysses$"):
        reg.variant("nope")
    with pytest.raises(
        ConfigError,
        match=r"'ring' is provided by the autosp-ring package, which is blocked by "
        r"AUTOSP_BLOCK_PLUGINS: remove 'autosp-ring' from it",
    ):
        reg.variant("ring")
    with pytest.raises(ConfigError, match=r"autosp-ring package, which is blocked"):
        reg.variant("hybrid")
    monkeypatch.setenv(BLOCK_ENV, "autosp-ulysses,autosp-ring")
    reset_registry()
    with pytest.raises(ConfigError, match=r"unknown SP variant 'nope'; installed variants: none installed"):
        get_registry().variant("nope")


def test_misspelt_variant_is_caught_on_one_rank_too():
    # A typo must not pass silently just because the first run happens on one process.
    with pytest.raises(autosp.ConfigError, match="unknown SP variant 'nope'"):
        autosp.backend(sp_size=1, variant="nope")


# --- a real process group of 3 ranks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def spmd_errors():
    from _core_spmd_cases import config_errors
    from harness import run_spmd

    return run_spmd(config_errors, 3, fresh=True)


def _on_every_rank(results, key):
    errors = [r[key] for r in results]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0] is not None, f"{key}: nothing was raised"
    return errors[0]


COMPILE_ERRORS = ("seq_not_divisible", "heads_not_divisible", "two_lengths", "made_in_model")


def test_no_collective_before_the_errors(spmd_errors):
    for r in spmd_errors:
        called = r["collectives_called"]
        assert set(called) == set(COMPILE_ERRORS) | {
            "unknown_variant",
            "ring_variant",
            "sp_not_dividing",
            "sp_too_large",
            "bad_backend",
            "group_and_smaller_sp",
        }
        for case, names in called.items():
            # Errors in a compile: the one all-reduce by which the ranks agree that it failed (and
            # nothing of the SP program); errors in the options: nothing at all.
            assert names == (["all_reduce"] if case in COMPILE_ERRORS else []), (case, names)


def test_spmd_unknown_variant(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "unknown_variant")
    assert kind == "ConfigError" and "unknown SP variant 'nope'; installed variants:" in msg and "ulysses" in msg


def test_spmd_variant_not_installed(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "ring_variant")
    assert kind == "ConfigError"
    assert "autosp-ring package, which is blocked by AUTOSP_BLOCK_PLUGINS" in msg


def test_spmd_sp_size_not_dividing_group(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "sp_not_dividing")
    assert kind == "ConfigError"
    assert "sp_size=2 does not divide the process group of 3 ranks" in msg and "divisor of 3" in msg


def test_spmd_sp_size_too_large(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "sp_too_large")
    assert kind == "ConfigError" and "sp_size=4 is larger than the process group (3 ranks)" in msg


def test_spmd_bad_backend(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "bad_backend")
    assert kind == "ConfigError" and "backend='tvm'" in msg


def test_spmd_group_smaller_than_given_group(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "group_and_smaller_sp")
    assert kind == "ConfigError" and "pass the SP group itself as group=" in msg


def _autosp_error(kind):
    # Raised inside the Dynamo backend: Dynamo wraps it, keeping the AutoSPError as inner_exception.
    return kind in ("AutoSPError", "BackendCompilerFailed>AutoSPError")


def test_spmd_sequence_not_divisible(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "seq_not_divisible")
    assert _autosp_error(kind), kind
    assert "sequence length 8 is not divisible by sp_size=3" in msg and "pad" in msg
    assert "or use variant='ulysses', which takes any length" in msg, msg


def test_spmd_length_made_in_the_model_not_divisible(spmd_errors):
    # No input holds the 10 tokens (9 patches and a [CLS] token): padding the batch would not help.
    kind, msg = _on_every_rank(spmd_errors, "made_in_model")
    assert _autosp_error(kind), kind
    assert "sequence length 10 is made inside the model" in msg and "sp_size=3" in msg and "pad" not in msg, msg


def test_spmd_heads_not_divisible(spmd_errors):
    kind, msg = _on_every_rank(spmd_errors, "heads_not_divisible")
    assert _autosp_error(kind), kind
    assert "4 query heads, not divisible by sp_size=3" in msg and "variant='ring'" in msg


def test_spmd_self_attention_over_dynamic_lengths_that_disagree(spmd_errors):
    # With static lengths the longest is sharded and the rest runs whole (probe "encoder-decoder" in
    # integration_tests/test_probe_programs.py); with dynamic ones no length is the longest for every call.
    kind, msg = _on_every_rank(spmd_errors, "two_lengths")
    assert _autosp_error(kind), kind
    assert "attention sites disagree on the sequence length ([6, 9]) and a length is dynamic" in msg, msg


def test_spmd_dynamic_shapes_work_or_fail_clearly(spmd_errors):
    for r in spmd_errors:
        if r["dynamic"] is None:
            got, want = r["dynamic_loss"]
            assert got == pytest.approx(want, rel=1e-5)
        else:
            assert _autosp_error(r["dynamic"][0]), r["dynamic"]


def test_autosp_error_hierarchy():
    assert issubclass(ConfigError, AutoSPError) and issubclass(ConfigError, ValueError)
    assert issubclass(AutoSPError, RuntimeError)


def test_sac_true_without_autosp_sac_is_an_error(fresh_registry, monkeypatch):
    from autosp.registry import reset_registry

    monkeypatch.setenv(BLOCK_ENV, "autosp-sac")
    reset_registry()
    reg = get_registry()
    with pytest.raises(
        ConfigError,
        match=r"sac=True needs the autosp-sac package, which is blocked by "
        r"AUTOSP_BLOCK_PLUGINS: remove 'autosp-sac' from it",
    ):
        reg.require_sac(True)
    reg.require_sac("auto")  # auto chooses among what is installed: the default partitioner here
    reg.require_sac(False)
    reg.manager.is_blocked = lambda name: False  # as if it were simply not installed
    with pytest.raises(
        ConfigError,
        match=r"sac=True needs the autosp-sac package, which is not installed: "
        r"pip install autosp-sac",
    ):
        reg.require_sac(True)
