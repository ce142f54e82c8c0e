"""Guards in one process: options, naming inputs, fingerprints, mismatch text, the eager-fallback guard.

The multi-rank behaviour (the check's collective, timeouts) is in integration_tests/test_guards.py.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import re
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _core_helpers import TinyAttention

import autosp
from autosp import AutoSPError, ConfigError, SPOptions
from autosp.guards import EagerFallback, GraphRuns, GuardedCall, is_comm_failure, recompile_message
from autosp.input_check import Leaf, fingerprint, flatten_inputs, mismatch_message, signature_of

# --- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "mode"),
    [("tokens", "tokens"), ("shapes", "shapes"), ("hash", "hash"), ("off", "off"), (False, "off"), (True, "tokens")],
)
def test_check_inputs_values(given, mode):
    assert SPOptions(check_inputs=given).check_inputs == mode


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"check_inputs": "content"}, r"check_inputs='content'; use 'tokens', 'shapes', 'hash' or 'off' \(or False\)"),
        ({"timeout": 0}, r"timeout=0; give seconds > 0 \(or a timedelta\), or None"),
        ({"timeout": -1.5}, r"timeout=-1.5; give seconds > 0"),
        ({"timeout": "30"}, r"timeout='30'; give seconds > 0"),
        ({"timeout": True}, r"timeout=True; give seconds > 0"),
        ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\); give seconds > 0"),
        ({"timeout": 5, "group": object()}, r"group= was given.*dist.new_group\(ranks, timeout=timedelta"),
    ],
)
def test_bad_guard_options(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SPOptions(**kwargs)
    if "group" not in kwargs:
        with pytest.raises(ConfigError, match=pattern):
            autosp.compile(TinyAttention(), **kwargs)


def test_timeout_in_seconds_or_timedelta():
    assert SPOptions(timeout=2.5).timeout_delta == timedelta(seconds=2.5)
    assert SPOptions(timeout=timedelta(minutes=1)).timeout_delta == timedelta(seconds=60)
    assert SPOptions().timeout_delta is None
    # One process, no process group: nothing to time out, the options are only checked.
    assert not dist.is_initialized()
    autosp.compile(TinyAttention(), timeout=5, check_inputs="hash")


# --- naming inputs ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    step: int


def _model(input_ids, labels=None, *extra, batch=None, **options):
    return input_ids


def test_inputs_are_named_as_the_model_names_them():
    sig = signature_of(_model)
    ids, w = torch.zeros(2, 8, dtype=torch.long), torch.nn.Parameter(torch.ones(3))
    leaves = flatten_inputs(
        (ids, ids.float(), torch.ones(1), w),
        {
            "batch": {"mask": torch.ones(2, 8, dtype=torch.bool), "rows": [ids, Batch(ids, 3)]},
            "flag": True,
            "dtype": torch.bfloat16,
            "device": torch.device("cpu", 0),
            "obj": object(),
        },
        sig,
    )
    got = {leaf.path: leaf.meta for leaf in leaves}
    assert got == {
        "input_ids": "tensor [2, 8] int64 cpu",
        "labels": "tensor [2, 8] float32 cpu",
        "extra[0]": "tensor [1] float32 cpu",  # the Parameter (extra[1]) is not an input to compare
        "batch['mask']": "tensor [2, 8] bool cpu",
        "batch['rows'][0]": "tensor [2, 8] int64 cpu (the same tensor as input_ids)",
        "batch['rows'][1].ids": "tensor [2, 8] int64 cpu (the same tensor as input_ids)",
        "batch['rows'][1].step": "int 3",
        "device": "device cpu",  # device type only: SP ranks use cuda:0, cuda:1, ...
        "dtype": "dtype torch.bfloat16",
        "flag": "bool True",
        "obj": "object object",  # by type: a repr may hold a per-process address
    }
    assert [leaf.path for leaf in leaves][:3] == ["input_ids", "labels", "extra[0]"]


def test_inputs_of_a_module_and_of_a_call_that_does_not_bind():
    leaves = flatten_inputs((torch.zeros(1, 4, 16, requires_grad=True),), {}, signature_of(TinyAttention()))
    assert [(leaf.path, leaf.meta) for leaf in leaves] == [("x", "tensor [1, 4, 16] float32 cpu requires_grad")]
    # Too many arguments: the model raises its own error; until then inputs are named by position.
    leaves = flatten_inputs((torch.zeros(2), torch.zeros(3)), {"k": 1}, signature_of(TinyAttention()))
    assert [leaf.path for leaf in leaves] == ["args[0]", "args[1]", "k"]


def test_a_generator_passed_in_is_compared_by_its_state():
    # Dynamo draws from it in eager (a graph break): generators in other states are other inputs.
    def meta(seed: int, draws: int = 0) -> str:
        g = torch.Generator().manual_seed(seed)
        torch.rand(draws, generator=g)
        return flatten_inputs((torch.zeros(2),), {"generator": g}, None)[1].meta

    assert meta(1).startswith("generator cpu state ")
    assert meta(1) == meta(1) and meta(1) != meta(2) and meta(1) != meta(1, draws=3)


def test_a_tensor_passed_twice_differs_from_two_copies():
    # Dynamo makes one graph input of a repeated tensor, two of two copies: other programs.
    ids = torch.zeros(2, 4, dtype=torch.long)
    twice = flatten_inputs((ids, ids), {}, None)
    copies = flatten_inputs((ids, ids.clone()), {}, None)
    assert twice[1].meta == "tensor [2, 4] int64 cpu (the same tensor as args[0])"
    assert [leaf.meta for leaf in twice] != [leaf.meta for leaf in copies]


class Mode(enum.Enum):
    FAST = 1
    EXACT = 2


class Settings:
    def __init__(self, temperature: float) -> None:
        self.temperature, self.mode = temperature, Mode.EXACT


def test_settings_objects_enums_and_layouts_are_compared():
    """What Dynamo guards on must differ in the digest too: a config object's attributes, an enum's
    member, a tensor's strides (ranks that differ compile other programs; once silently wrong)."""
    import types

    def metas(*args: object) -> list[tuple[str, str]]:
        return [(leaf.path, leaf.meta) for leaf in flatten_inputs(args, {}, None)]

    assert metas(Settings(0.5)) == [
        ("args[0]", "object Settings"),
        ("args[0].mode", "Mode.EXACT"),
        ("args[0].temperature", "float 0.5"),
    ]
    assert metas(Settings(0.5)) != metas(Settings(0.7))
    assert metas(types.SimpleNamespace(k=3)) != metas(types.SimpleNamespace(k=4))
    assert metas(Mode.FAST) == [("args[0]", "Mode.FAST")]
    x = torch.zeros(4, 2)
    assert metas(x.t()) == [("args[0]", "tensor [2, 4] float32 cpu strides [1, 2]")]
    assert metas(x.t().contiguous()) == [("args[0]", "tensor [2, 4] float32 cpu")]
    # Modules and functions stay compared by type: their attributes are the model's, not the batch's.
    assert metas(TinyAttention(), len) == [
        ("args[0]", "object TinyAttention"),
        ("args[1]", "object builtin_function_or_method"),
    ]


def test_the_program_state_is_compared() -> None:
    from autosp.input_check import program_state

    model = TinyAttention()
    train = program_state(model)
    with torch.no_grad():
        assert program_state(model)[0].meta == "enabled False" != train[0].meta
    model.eval()
    assert program_state(model)[-1].meta != train[-1].meta
    model.train()
    model.o.weight.requires_grad_(False)
    assert program_state(model)[-1].meta != train[-1].meta
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ("(autocast cpu)", "dtype torch.bfloat16") in [(leaf.path, leaf.meta) for leaf in program_state(model)]


def test_dict_order_does_not_matter():
    a = flatten_inputs(({"x": torch.zeros(1), "y": 2},), {}, None)
    b = flatten_inputs(({"y": 2, "x": torch.zeros(1)},), {}, None)
    assert [(leaf.path, leaf.meta) for leaf in a] == [(leaf.path, leaf.meta) for leaf in b]


# --- fingerprints -----------------------------------------------------------------------------------


def test_fingerprint_sees_every_changed_element_and_swaps():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 64), generator=gen)
    base = int(fingerprint(ids))
    assert int(fingerprint(ids.clone())) == base
    assert int(fingerprint(ids.t().contiguous().t())) == base  # layout is not content
    seen = {base}
    for i in range(ids.numel()):
        changed = ids.clone().view(-1)
        changed[i] += 1
        seen.add(int(fingerprint(changed.view(2, 64))))
    assert len(seen) == ids.numel() + 1
    for i in range(0, 63):
        swapped = ids.clone()
        swapped[0, i], swapped[0, i + 1] = ids[0, i + 1], ids[0, i]
        if not torch.equal(swapped, ids):
            assert int(fingerprint(swapped)) != base, i
    assert int(fingerprint(ids.view(4, 32))) == base  # same bytes: the shape is compared separately


def test_fingerprint_across_chunks_and_dtypes():
    big = torch.arange(200_000, dtype=torch.int32)
    base = int(fingerprint(big))
    # The same block of values moved to another chunk must not hash the same.
    moved = torch.cat([big[65536:131072], big[:65536], big[131072:]])
    assert int(fingerprint(moved)) != base
    late = big.clone()
    late[-1] += 1
    assert int(fingerprint(late)) != base
    for t in (
        torch.randn(5, 3).half(),
        torch.randn(4, dtype=torch.complex64),
        torch.tensor([True, False]),
        torch.randn(3, 3, dtype=torch.float64),
        torch.randn(2, 2).bfloat16(),
    ):
        assert int(fingerprint(t)) == int(fingerprint(t.clone()))
        other = t.clone()
        other.view(-1)[0] = other.view(-1)[1] if t.dtype == torch.bool else other.view(-1)[0] + 1
        if not torch.equal(other, t):
            assert int(fingerprint(other)) != int(fingerprint(t)), t.dtype


# --- messages -----------------------------------------------------------------------------------------


def test_mismatch_message_groups_ranks_by_what_they_got():
    a = [("input_ids", "tensor [2, 64] int64 cpu", 1), ("labels", "tensor [2, 64] int64 cpu", 2)]
    b = [("input_ids", "tensor [1, 128] int64 cpu", 1), ("labels", "tensor [2, 64] int64 cpu", 2)]
    c = [("input_ids", "tensor [2, 64] int64 cpu", 1), ("labels", "tensor [2, 64] int64 cpu", 3)]
    msg = mismatch_message([a, b, a, c], [4, 5, 6, 7])
    assert "  input_ids: ranks 4, 6, 7: tensor [2, 64] int64 cpu; rank 5: tensor [1, 128] int64 cpu\n" in msg
    assert "  labels (tensor [2, 64] int64 cpu): different contents: ranks 4, 5, 6 / rank 7\n" in msg
    missing = mismatch_message([a, a[:1]], [0, 1])
    assert "labels: rank 0: tensor [2, 64] int64 cpu; rank 1: missing" in missing


def test_recompile_message_has_numbers_and_what_to_do():
    leaves = [Leaf("batch['ids']", "tensor [2, 72] int64 cpu", torch.zeros(2, 72)), Leaf("n", "int 3")]
    msg = recompile_message(leaves, ["batch['ids'] [2, 8]", "batch['ids'] [2, 16]"])
    assert f"recompile_limit={torch._dynamo.config.recompile_limit}" in msg
    assert "this call (batch['ids'] [2, 72] with n=3)" in msg  # plain values too: they compile graphs
    assert "a plain value differs" not in msg  # the lengths changed, not n
    assert "earlier calls: batch['ids'] [2, 8]; batch['ids'] [2, 16]" in msg
    assert "torch._dynamo.mark_dynamic(batch['ids'], 1)" in msg


def test_comm_failures_are_told_apart():
    assert is_comm_failure(RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"))
    assert is_comm_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert is_comm_failure(RuntimeError("Application timeout caused pair closure"))
    assert is_comm_failure(dist.DistBackendError("NCCL watchdog"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_failure(ValueError("Timed out"))


# --- the eager-fallback guard, with Dynamo for real (one process, a tiny function) ---------------------


def _guarded(fn):
    runs = GraphRuns()

    def record(gm, example_inputs):
        return runs.wrap(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=record, dynamic=False)
    return GuardedCall(compiled, fn, None, None, runs)


def _double(x):
    return x * 2 + 1


def test_recompile_limit_raises_instead_of_running_eager():
    call = _guarded(_double)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in (3, 4):
            torch.testing.assert_close(call(torch.ones(n)), torch.full((n,), 3.0))
        with pytest.raises(
            EagerFallback,
            match=r"recompile_limit=2\): this call \(x \[5\]\).*earlier calls: "
            r"x \[3\]; x \[4\]\..*mark_dynamic\(x, 0\)",
        ):
            call(torch.ones(5))
        torch.testing.assert_close(call(torch.ones(4)), torch.full((4,), 3.0))  # known shapes still run
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False  # only inside the call
    torch._dynamo.reset()


def test_dynamo_and_fastpath_settings_hold_during_the_call_only():
    # transformers 5's hub-kernel layers set a Python variable inside HF's checkpointed layers: without
    # this setting Dynamo runs those layers in eager, outside every graph (test_hf_matrix.py has the model).
    seen = []
    runs = GraphRuns()

    # And a graph break inside torch's own modules resumes there (nn.TransformerEncoder's layers ran
    # in eager otherwise: test_probe_programs.py::test_code_dynamo_runs_in_eager).
    def record(gm, example_inputs):
        cfg = torch._dynamo.config
        fastpath = torch.backends.mha.get_fastpath_enabled()  # fused attention no rule splits: off
        seen.append((cfg.skip_fwd_side_effects_in_bwd_under_checkpoint, cfg.nested_graph_breaks, fastpath))
        return runs.wrap(gm.forward)

    torch._dynamo.reset()
    call = GuardedCall(torch.compile(_double, backend=record, dynamic=False), _double, None, None, runs)
    call(torch.ones(3))
    assert seen == [(True, True, False)]
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False
    assert torch._dynamo.config.nested_graph_breaks is False
    assert torch.backends.mha.get_fastpath_enabled() is True
    torch._dynamo.reset()


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 3


class _HooksOnFirstCall(torch.nn.Module):
    """Registers hooks on its child the first time it runs, from a nested call (transformers 5's
    output capturing does so for ``output_hidden_states``)."""

    def __init__(self, register: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register, self.handle = register, None

    def install(self) -> None:
        if self.handle is None:
            if self.register == "register_forward_hook":
                self.handle = self.lin.register_forward_hook(lambda m, a, out: out * 2)
            else:
                self.handle = self.lin.register_forward_pre_hook(lambda m, a: (a[0] + 1,))

    def forward(self, x):
        self.install()
        return self.lin(x)


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook"])
def test_a_module_hook_registered_inside_the_call_runs_as_in_eager(register):
    # Dynamo 2.13 with nested breaks handed the resumed registration a fresh dict for the child's
    # empty hook dict: "cannot create weak reference to 'dict' object" (autosp.dynamo_fixes).
    runs = GraphRuns()
    model, ref = _HooksOnFirstCall(register), _HooksOnFirstCall(register)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 3)
    torch._dynamo.reset()
    call = GuardedCall(torch.compile(model, backend=lambda gm, ex: runs.wrap(gm.forward)), model, None, None, runs)
    for _ in range(2):
        torch.testing.assert_close(call(x), ref(x))
    assert len(getattr(model.lin, f"_forward{'_pre' if 'pre' in register else ''}_hooks")) == 1
    model.handle.remove()  # the handle holds the child's own dict
    ref.handle.remove()
    torch.testing.assert_close(call(x), ref(x))
    torch._dynamo.reset()


class _ValuesAcrossBreaks(torch.nn.Module):
    """Holds an ``OrderedDict``'s values view across graph breaks: the resumed frames take it as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = collections.OrderedDict(a=torch.tensor(2.0), b=torch.tensor(3.0))

    def forward(self, x):
        scales = self.scales.values()
        x = x + 1
        torch._dynamo.graph_break()
        return self._nested(x, scales)

    def _nested(self, x, scales):
        x = x * 2
        torch._dynamo.graph_break()  # nested: the resumed frame of forward's callee holds the view too
        for s in scales:
            x = x * s
        return x


def test_an_ordered_dicts_values_view_held_across_a_graph_break_runs_as_in_eager():
    # Dynamo 2.13 guarded the view's items as view[i]: "'odict_values' object is not subscriptable",
    # an InternalTorchDynamoError (autosp.dynamo_fixes). Transformers' signature binding holds one.
    runs = GraphRuns()
    model = _ValuesAcrossBreaks()
    x = torch.randn(3)
    torch._dynamo.reset()
    call = GuardedCall(torch.compile(model, backend=lambda gm, ex: runs.wrap(gm.forward)), model, None, None, runs)
    for _ in range(2):
        torch.testing.assert_close(call(x), (x + 1) * 2 * 6)
    torch._dynamo.reset()


class _SlicesInAComprehension(torch.nn.Module):
    """Pixtral's form: each row sliced by a size held in a tensor (a break), in a list comprehension."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, sizes):
        h = self.lin(x)
        return torch.cat([row[..., : (n[0] // 1)] for row, n in zip(h, sizes)]).sum()


class _CallsTheComprehension(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _SlicesInAComprehension()

    def forward(self, x, sizes):
        return self.inner(x * 2, sizes) + 1  # the comprehension's function inlined two calls deep


def test_a_graph_break_inside_a_comprehension_runs_as_in_eager():
    # Dynamo 2.13 with nested breaks resumed the break inside <listcomp> without its iterator:
    # "cannot access local variable '.0'" (autosp.dynamo_fixes). Mistral-3's Pixtral tower crashed so.
    runs = GraphRuns()
    model = _CallsTheComprehension()
    x, sizes = torch.randn(2, 3), torch.tensor([[2, 2], [3, 3]])
    torch._dynamo.reset()
    call = GuardedCall(torch.compile(model, backend=lambda gm, ex: runs.wrap(gm.forward)), model, None, None, runs)
    for _ in range(2):
        torch.testing.assert_close(call(x, sizes), model(x, sizes))
    torch._dynamo.reset()


def _values_count(x, view):
    return x * len(view)


def _a_comprehension(xs):
    return [x for x in xs]


def test_the_dynamo_fixes_hold_only_inside_autosps_calls():
    # The values-view fix makes a break of a frame that plain Dynamo compiles (it takes only the
    # view's length): other compiles in the process, with fullgraph=True, must not fail on it.
    from torch._dynamo.variables.functions import UserFunctionVariable

    from autosp import dynamo_fixes

    dynamo_fixes.install()
    view, x = collections.OrderedDict(a=1, b=2).values(), torch.ones(2)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_values_count, backend="eager", fullgraph=True)(x, view), x * 2)
    torch._dynamo.reset()
    with dynamo_fixes.applied(), pytest.raises(torch._dynamo.exc.Unsupported, match="values view"):
        torch.compile(_values_count, backend="eager", fullgraph=True)(x, view)
    torch._dynamo.reset()

    if sys.version_info < (3, 12):  # later, a comprehension is no function of its own (PEP 709)
        code = next(c for c in _a_comprehension.__code__.co_consts if getattr(c, "co_name", "") == "<listcomp>")
        comprehension = UserFunctionVariable(type(_a_comprehension)(code, {}))
        with dynamo_fixes.applied():
            assert not comprehension.should_allow_nested_graph_breaks()
        assert comprehension.should_allow_nested_graph_breaks()


@pytest.mark.filterwarnings(r"ignore:Using `torch\.compile\(module\)` when there are global hooks")
def test_nested_graph_breaks_stay_off_while_a_module_has_backward_hooks():
    # Dynamo 2.13 cannot resume a break inside the list comprehension of torch's backward-hook setup
    # with nested breaks on: an UnboundLocalError, for plain torch.compile too (probe "hook-module").
    seen = []
    runs = GraphRuns()

    def record(gm, example_inputs):
        seen.append(torch._dynamo.config.nested_graph_breaks)
        return runs.wrap(gm.forward)

    x = torch.ones(3, requires_grad=True)
    for register in ("register_full_backward_hook", "register_full_backward_pre_hook"):
        model = _Scale()
        handle = getattr(model, register)(lambda *a: None)
        torch._dynamo.reset()
        seen.clear()
        call = GuardedCall(torch.compile(model, backend=record, dynamic=False), model, None, None, runs)
        call(x).sum().backward()
        assert seen and not any(seen), (register, seen)
        handle.remove()
        torch._dynamo.reset()
        seen.clear()
        call(x)  # the hook removed: nested breaks are back on
        assert seen and all(seen), (register, seen)
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None)
    try:
        torch._dynamo.reset()
        seen.clear()
        call(x)
        assert seen and not any(seen), seen
    finally:
        handle.remove()
    torch._dynamo.reset()


def test_suppressed_errors_do_not_turn_autosp_errors_into_eager():
    def refuse(gm, example_inputs):
        raise AutoSPError("no attention site (stand-in for any AutoSP refusal)")

    runs = GraphRuns()
    torch._dynamo.reset()
    call = GuardedCall(torch.compile(_double, backend=refuse), _double, None, None, runs)
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.raises(AutoSPError, match="stand-in for any AutoSP refusal"):
            call(torch.ones(3))
        assert torch._dynamo.config.suppress_errors is True
    torch._dynamo.reset()


def _scaled(x, n):
    return x * n


def test_recompiles_from_a_plain_value_name_that_value():
    """Same shapes every call, a Python int that changes: the message says so, not only "lengths"."""
    call = _guarded(_scaled)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in (1, 2):
            call(torch.ones(3), n)
        with pytest.raises(EagerFallback) as e:
            call(torch.ones(3), 3)
    msg = str(e.value)
    assert "this call (x [3] with n=3)" in msg and "x [3] with n=1; x [3] with n=2" in msg, msg
    assert "a plain value differs (n=3)" in msg and "torch.tensor(n)" in msg, msg
    torch._dynamo.reset()


def _block(x, i):
    torch._dynamo.graph_break()  # BigBird's block plan draws from numpy here
    return x * 2 if i % 2 else x + i  # the resumed code is compiled once per value of i


def _blocks(x):
    for i in range(4):
        x = _block(x, i)
    return x


def test_recompiles_within_the_first_call_name_the_function_not_the_lengths():
    """A loop calls a function with another int each time: the limit is reached inside one call."""
    call = _guarded(_blocks)
    with torch._dynamo.config.patch(recompile_limit=2):
        with pytest.raises(EagerFallback) as e:
            call(torch.ones(3))
    msg = str(e.value)
    assert "inside the first call (x [3])" in msg and "resume_in__block" in msg, msg
    assert "Dynamo's reason: " in msg and "i == " in msg and "torch.compiler.disable" in msg, msg
    assert "mark_dynamic" not in msg, msg  # nothing about the lengths: one call, one length
    torch._dynamo.reset()


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x):
        self.step += 1  # an int attribute: Dynamo specialises on it, a graph per value
        return x * self.step


def test_recompiles_from_a_module_attribute_name_it_not_the_lengths():
    """Same inputs every call, a step counter on the module: the message gives Dynamo's reason."""
    call = _guarded(_Counted())
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(2):
            call(torch.ones(3))
        with pytest.raises(EagerFallback) as e:
            call(torch.ones(3))
    msg = str(e.value)
    assert "Its inputs are an earlier call's" in msg and "Dynamo's reason: " in msg, msg
    assert "self.step == 1" in msg and "in a tensor (a buffer)" in msg, msg
    assert "mark_dynamic" not in msg, msg  # the lengths did not change: no advice about them
    handlers = logging.getLogger("torch._dynamo.convert_frame").handlers
    assert not [h for h in handlers if type(h).__name__ == "_RecompileReason"], "the capture outlived the call"
    torch._dynamo.reset()


def _drops_layers(x):
    for _ in range(2):
        if torch.rand([]) < 0.5:  # LayerDrop: a data-dependent branch inside a loop
            continue
        x = x * 2
    return x


def test_a_call_that_ran_no_autosp_graph_is_an_error():
    call = _guarded(_double)
    call(torch.ones(3))
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(EagerFallback, match=r"ran without AutoSP.*force_eager"):
            call(torch.ones(3))
    call(torch.ones(3))
    # Dynamo gives up on the whole frame at a graph break inside a loop: the message names that case.
    with pytest.raises(EagerFallback, match=r"Dynamo skipped the forward \(a graph break .* inside a loop"):
        _guarded(_drops_layers)(torch.ones(3))
    torch._dynamo.reset()


def test_guarded_module_keeps_its_type_and_hooks():
    from autosp.guards import guard_compiled

    model = TinyAttention()
    runs = GraphRuns()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: runs.wrap(gm.forward))
    seen = []
    compiled.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    guarded = guard_compiled(compiled, model, GuardedCall(compiled.forward, model, None, None, runs))
    assert guarded is compiled and isinstance(guarded, torch._dynamo.eval_frame.OptimizedModule)
    x = torch.randn(1, 4, 16)
    torch.testing.assert_close(guarded(x), model(x))
    assert seen == [x.shape] and runs.count == 1
    assert set(guarded.state_dict()) == {f"_orig_mod.{k}" for k in model.state_dict()}  # as torch.compile's
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["module", "function"])
def test_a_program_called_inside_another_torch_compile_runs_as_compiled(kind: str) -> None:
    """Dynamo would inline the model into the outer graph, under the outer backend: without AutoSP,
    silently whole on every rank. The call breaks the outer graph and runs its own program."""
    from autosp.guards import guard_compiled

    model = TinyAttention()
    runs = GraphRuns()
    torch._dynamo.reset()
    if kind == "module":
        compiled = torch.compile(model, backend=lambda gm, ex: runs.wrap(gm.forward))
        inner = guard_compiled(compiled, model, GuardedCall(compiled.forward, model, None, None, runs))
    else:
        compiled = torch.compile(model.forward, backend=lambda gm, ex: runs.wrap(gm.forward))
        inner = GuardedCall(compiled, model, None, None, runs)
    outer_graphs = []

    def outer_backend(gm, ex):
        outer_graphs.append(gm)
        return gm.forward

    outer = torch.compile(lambda x: inner(x.sin()).cos(), backend=outer_backend)
    x = torch.randn(1, 4, 16, requires_grad=True)
    out = outer(x)
    assert runs.count == 1, "the inner program did not run: the outer graph inlined the model"
    ref_x = x.detach().clone().requires_grad_()
    ref = model(ref_x.sin()).cos()
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert outer_graphs and not any("linear" in str(n.target) for gm in outer_graphs for n in gm.graph.nodes), (
        "the model's ops were traced into the outer graph"
    )
    torch._dynamo.reset()


# --- find_attention's messages print numbers, also for a symbolic length ---------------------------


def test_non_divisible_symbolic_length_prints_the_number(monkeypatch):
    from autosp.compiler import make_context
    from autosp.passes.core import find_attention, lower
    from autosp.registry import get_registry

    # A 2-rank context without a process group: settling the length needs the world size, not peers.
    monkeypatch.setattr("autosp.compiler.dist.get_rank", lambda group=None: 0)

    def backend(gm, example_inputs):
        ctx = make_context(gm, example_inputs, SPOptions(), get_registry(), None, 2)
        find_attention(gm, ctx)
        lower(gm, ctx)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(1, 33, 16)
    torch._dynamo.mark_dynamic(x, 1)
    with pytest.raises(AutoSPError, match=r"sequence length 33 is not divisible by sp_size=2") as err:
        torch.compile(TinyAttention(), backend=backend)(x)
    assert not re.search(r"\bs\d+\b", str(err.value).split("\n")[0]), str(err.value)
    # Marked, but the lowering fixed it (the fused qkv projection's bias): the message says so and what to do.
    assert "compiling fixed the length marked dynamic" in str(err.value), str(err.value)
    assert "compile without marking it, or mark every input of that length" in str(err.value), str(err.value)
    torch._dynamo.reset()


def test_default_mode_compares_tokens_whole_and_floats_by_sample():
    from autosp.input_check import compared, fingerprint

    ids, mask, emb = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), torch.zeros(2, 4, 8)
    assert SPOptions().check_inputs == "tokens"
    assert compared(ids, "tokens") is ids and compared(mask, "tokens") is mask
    assert torch.equal(compared(emb, "tokens"), emb.reshape(-1))  # small: every element
    assert all(compared(t, "hash") is t for t in (ids, mask, emb))
    assert all(compared(t, mode) is None for t in (ids, mask, emb) for mode in ("shapes", "off"))

    # A large float input: a bounded sample that crosses every feature column and every row.
    big = torch.randn(4, 4096, 64)
    sample = compared(big, "tokens")
    assert sample.numel() <= 1 << 16
    step = sample.stride(0)
    assert step > 1 and math.gcd(step, 64) == 1
    assert len({(i * step) % 64 for i in range(sample.numel())}) == 64
    other_rows = big.clone()
    other_rows[1:] = torch.randn(3, 4096, 64)  # another batch in all rows but the first
    assert fingerprint(compared(other_rows, "tokens")) != fingerprint(sample)
    assert fingerprint(compared(big.clone(), "tokens")) == fingerprint(sample)


def test_not_sharded_message_points_at_graph_breaks_and_the_forms_found():
    """Attention at a graph break (nn.MultiheadAttention warning on mixed mask types) or written in a form
    not found runs whole, warned: the message names both causes, the break only where Dynamo split."""
    from types import SimpleNamespace

    from autosp.guards import not_sharded_message

    def graph(failed: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(notes=[], compiled_whole=failed)

    one = not_sharded_message(2, [graph()])
    two = not_sharded_message(2, [graph(), graph()])
    assert "bmm, baddbmm or einsum" in one and "graph break" not in one
    assert "split this program into 2 graphs" in two and "TORCH_LOGS=graph_breaks" in two
    # A graph AutoSP failed to compile (autosp.whole) is named as the cause, not missing attention.
    failed = not_sharded_message(2, [graph("RuntimeError: boom")])
    assert "failed to compile them (RuntimeError: boom)" in failed and "no attention" not in failed
    mixed = not_sharded_message(2, [graph("RuntimeError: boom"), graph()])
    assert (
        "failed to compile 1 of them (RuntimeError: boom" in mixed and "no attention was found in the others" in mixed
    )


def test_incoming_gradient_statistics_agree_within_tolerance_and_on_nan():
    from autosp.input_check import _gradient_stats, _stats_apart

    g = torch.randn(4, 8, 16)
    same, noisy, scaled = _gradient_stats(g), _gradient_stats(g * (1 + 1e-9)), _gradient_stats(g * 0.5)
    assert _stats_apart([same, noisy]) == [[0, 1]]  # summation-order noise of a nondeterministic kernel
    assert _stats_apart([same, scaled, same]) == [[0, 2], [1]]  # a loss scaled on one rank
    nan = _gradient_stats(torch.full((3,), float("nan")))
    inf = _gradient_stats(torch.tensor([float("inf"), 1.0]))
    assert _stats_apart([nan, nan]) == [[0, 1]] and _stats_apart([inf, inf]) == [[0, 1]]  # diverged alike
    assert _stats_apart([nan, same]) == [[0], [1]]
    assert _gradient_stats(None) == _gradient_stats(torch.zeros(0)) == [0.0, 0.0, 0.0]


def test_ranks_checking_inputs_differently_are_told_so():
    # check_inputs="tokens" on one rank, "shapes" on the other, the same inputs: the message names
    # the option (it once said the contents differ).
    from autosp.input_check import InputCheck, InputMismatchError, Leaf
    from autosp.sharding.testing.threads import simulate

    def rank_fn(rank: int, _: str) -> str:
        ids = torch.arange(8)
        try:
            InputCheck(dist.group.WORLD, "tokens" if rank == 0 else "shapes")([Leaf("input_ids", "tensor [8]", ids)])
        except InputMismatchError as e:
            return str(e)
        return "ok"

    for message in simulate(rank_fn, 2):
        assert "(check_inputs): rank 0: 'tokens'; rank 1: 'shapes'" in message, message


def test_the_backward_check_hooks_only_what_the_program_computed():
    # A leaf returned as it came (a tensor passed in) lives on: hooked on every call, one backward
    # would run one more all-gather per earlier call (and a backward on one rank alone would hang).
    from autosp.guards import check_backward

    calls = []

    class Check:
        group = None

        def backward(self, grad):
            calls.append(grad.shape)

    leaf = torch.ones(3, requires_grad=True)
    for _ in range(3):
        computed = leaf * 2
        check_backward(Check(), (computed, leaf))
        (computed.sum() + leaf.sum()).backward()
    assert calls == [torch.Size([3])] * 3  # once per backward, for the computed output only
    check_backward(Check(), leaf)
    leaf.sum().backward()
    assert len(calls) == 3


def test_dispatch_modes_dynamo_would_skip_are_refused_and_infra_modes_are_not():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from autosp.guards import refuse_dispatch_modes

    refuse_dispatch_modes()  # no mode
    with FakeTensorMode():  # an infra mode: Dynamo compiles under it
        refuse_dispatch_modes()
    with (
        FlopCounterMode(display=False),
        pytest.raises(EagerFallback, match=r"TorchDispatchMode \(\w*FlopCounterMode\)"),
    ):
        refuse_dispatch_modes()
