"""Faults that used to be silent or hang now fail fast, with the same clear error on every rank.

Gloo ranks with the eager backend after AutoSP, to keep compiles short: one shared spawn for
inputs that differ between ranks and more shapes than Dynamo's recompile limit, fresh ones for
faults that leave a group unusable (a rank that raises in its own code or in its program and
stays alive, steps apart). Time bounds are generous (a loaded 2-core machine).
"""

from __future__ import annotations

import re

import guards_workers
import pytest
from harness import run_spmd

TIMEOUT_S = 2.0
FAST_S = 30.0  # an input error is raised before any compile: seconds even on a loaded machine


@pytest.fixture(scope="module")
def faults() -> list[dict]:
    return run_spmd(guards_workers.input_faults, 2, fresh=True)


def _error(result: dict, kind: str, *patterns: str) -> str:
    assert result["error"] == kind and result["autosp"], result
    for p in patterns:
        assert re.search(p, result["message"]), (p, result["message"])
    return result["message"]


def test_recompile_limit_is_an_error_not_eager(faults):
    for rank, r in enumerate(faults):
        first, second, third = r["limit"]
        assert first["error"] is None and second["error"] is None, (rank, r["limit"])
        msg = _error(
            third,
            "EagerFallback",
            r"recompile_limit=2\): this call \(input_ids \[2, 48\], labels \[2, 48\]\)",
            r"without sequence parallelism",
            r"earlier calls: input_ids \[2, 16\], labels \[2, 16\]; input_ids \[2, 32\], labels \[2, 32\]",
            re.escape("torch._dynamo.mark_dynamic(input_ids, 1)"),
            r"bucket lengths",
        )
        assert third["seconds"] < FAST_S, third
        assert msg == faults[0]["limit"][2]["message"]
        # Hard failure only inside AutoSP's calls: Dynamo's global flag is left as it was.
        assert r["fail_flag_after"] is False


def test_options_given_differently_per_rank_are_named(faults):
    for r in faults:
        for option, shown in (
            ("sp_size", "rank 0: 2; rank 1: 1"),
            ("check_inputs", "rank 0: 'tokens'; rank 1: 'off'"),
            ("timeout", "rank 0: None; rank 1: datetime.timedelta(seconds=60)"),
        ):
            result = r[f"options_{option}"]
            _error(result, "ConfigError", "called with different options", re.escape(f"  {option}: {shown}\n"))
            assert result["seconds"] < FAST_S, result


def test_mismatched_shapes_and_lengths(faults):
    for key, other in (("shapes", r"\[1, 128\]"), ("lengths", r"\[2, 32\]")):
        messages = set()
        for r in faults:
            messages.add(
                _error(
                    r[key],
                    "InputMismatch",
                    rf"input_ids: rank 0: tensor \[2, 64\] int64 cpu; rank 1: tensor {other} int64 cpu",
                    # labels=ids: one tensor passed twice, on both ranks
                    rf"labels: rank 0: tensor \[2, 64\] int64 cpu \(the same tensor as input_ids\); rank 1: "
                    rf"tensor {other} int64 cpu \(the same tensor as input_ids\)",
                    r"same full-length batch",
                )
            )
            assert r[key]["seconds"] < FAST_S, r[key]
        assert len(messages) == 1, messages  # the same error on every rank
    # The ranks stayed in step: a good call after the errors runs and agrees on the loss.
    assert faults[0]["same"]["error"] is None and faults[0]["same"]["loss"] == faults[1]["same"]["loss"]


def test_mismatched_tokens_are_caught_by_default(faults):
    for r in faults:
        _error(
            r["tokens_default"],
            "InputMismatch",
            r"input_ids \(tensor \[2, 64\] int64 cpu\): different contents: "
            r"rank 0 / rank 1",
        )
        assert "labels" not in r["tokens_default"]["message"]  # same labels on both ranks
        assert r["tokens_shapes_mode"]["error"] is None  # check_inputs="shapes" compares no contents
        # Floating-point contents only with "hash".
        _error(r["floats_default"], "InputMismatch", r"x \(tensor \[2, 16, 8\] float32 cpu\): different contents")
        _error(r["floats_hash"], "InputMismatch", r"x \(tensor \[2, 16, 8\] float32 cpu\): different contents")
        assert r["same_hash"]["error"] is None, r["same_hash"]
    assert faults[0]["same_hash"]["loss"] == faults[1]["same_hash"]["loss"]


def test_backend_used_directly_checks_inside_the_graph(faults):
    # The ranks traced graphs of other shapes: the compile agreement sees other programs, before the
    # check inside the graph runs, and names the inputs that differ.
    for r in faults:
        _error(
            r["backend_shapes"],
            "ProgramMismatch",
            r"the first difference: \"graph inputs: \[.*'\[2, 64\] torch.int64 False'.*on global ranks \[0\] against",
            r"'\[1, 128\] torch.int64 False'.*on global ranks \[1\]",
            r"called with the same inputs",
        )


def test_ranks_holding_different_weights_are_refused(faults):
    messages = {
        _error(
            r["params_differ"],
            "ParameterMismatch",
            # The call's check of the model's weights, before the graph's first-run check of what it reads.
            r"hold different parameters or buffers, 1 of \d+ that (the model holds|this graph reads)",
            r"  blocks\.0\.q\.weight: rank 0 / rank 1\n",
            r"torch\.manual_seed",
        )
        for r in faults
    }
    assert len(messages) == 1
    assert faults[0]["params_differ"]["seconds"] < FAST_S
    # Opting out of content checks opts out of this one too: the program runs (and matches no model).
    assert all(r["params_differ_shapes_mode"]["error"] is None for r in faults)


def test_a_dynamic_length_the_lowering_fixes_is_an_autosp_error(faults):
    messages = {
        _error(r["dynamic_fixed"], "AutoSPError", r"a length marked dynamic", r"Compile without marking it dynamic")
        for r in faults
    }
    assert len(messages) == 1


def test_backward_with_retain_graph_runs_twice_as_in_eager(faults):
    # The backward is compiled with the forward under SP; a donating one would refuse retain_graph.
    for r in faults:
        assert r["retain_graph"]["error"] is None, r["retain_graph"]
        assert r["retain_graph_grad"] < 1e-5, r["retain_graph_grad"]


def test_compiled_inside_a_checkpoint_recomputes_as_in_eager(faults):
    for r in faults:
        assert r["checkpointed"]["error"] is None, r["checkpointed"]
        assert r["checkpointed_grad"] < 1e-5, r["checkpointed_grad"]


@pytest.mark.parametrize("key", ["shorter_than_sp", "shorter_than_sp_break"])
def test_a_call_shorter_than_sp_size_runs_whole_as_in_eager(faults, key):
    # A decoding step after a sharded prefill: refused before, with advice (padding) that would change it.
    for r in faults:
        assert r[key]["error"] is None, r[key]
        assert r[key]["loss"] == pytest.approx(r[f"{key}_reference"], rel=1e-6)
        assert r[f"{key}_grad"] < 1e-5, r[f"{key}_grad"]
        (attention, notes), *after = r[f"{key}_reports"]
        assert attention is None and any("shorter than sp_size=2" in n and "runs whole" in n for n in notes), notes
        assert not any(n.startswith("cross-attention") for n in notes), notes
        # The head after the break: whole as well, where the prefill's length (16, its hidden size) sharded it.
        assert len(after) == (key == "shorter_than_sp_break"), after
        for seq, notes in after:
            assert seq is None and any("ran whole, or there was none" in n for n in notes), notes


def test_a_call_under_a_dispatch_mode_is_refused_and_leaves_later_calls_compiled(faults):
    for r in faults:
        _error(r["under_mode"], "EagerFallback", r"TorchDispatchMode \(\w*FlopCounterMode\)", r"outside the mode")
        assert r["after_mode"]["error"] is None, r["after_mode"]


def test_weights_that_part_after_the_first_call_are_refused(faults):
    # Optimizer steps on every rank: every call runs, the ranks agreeing on the loss.
    for i in range(2):
        assert all(r["stepped_alike"][i]["error"] is None for r in faults), [r["stepped_alike"] for r in faults]
        assert faults[0]["stepped_alike"][i]["loss"] == faults[1]["stepped_alike"][i]["loss"]
    # A weight changed on rank 1 alone: the next call's input check names it, on every rank.
    messages = {
        _error(
            r["stepped_apart"],
            "ParameterMismatch",
            r"hold different parameters or buffers, 1 of \d+ that the model holds",
            r"  blocks\.0\.q\.weight: rank 0 / rank 1\n",
            r"step the optimizer and load checkpoints on every SP rank alike",
        )
        for r in faults
    }
    assert len(messages) == 1
    # Values are compared, not versions: once they agree again, the program runs again.
    assert all(r["agree_again"]["error"] is None for r in faults), [r["agree_again"] for r in faults]
    assert faults[0]["agree_again"]["loss"] == faults[1]["agree_again"]["loss"]
    # Written through .data on rank 1 alone (a hand-written optimizer): no version counter moved,
    # and the ranks once ran on with other weights, silently.
    for r in faults:
        _error(r["data_written_apart"], "ParameterMismatch", r"blocks\.0\.q\.weight: rank 0 / rank 1\n")


def test_ranks_seeded_apart_are_refused_when_the_program_draws_random_numbers(faults):
    messages = {
        _error(
            r["rng_differs_p0.1"],
            "RandomStateMismatch",
            r"hold different cpu random number generator states \(rank 0 / rank 1; global ranks\)",
            r"draws random numbers: aten::(native_dropout|bernoulli)",
            r"dp_rank = global_rank // sp_size",
        )
        for r in faults
    }
    assert len(messages) == 1
    # The same seeding with dropout off draws nothing (SDPA with dropout_p=0 included): it runs, and agrees.
    assert all(r["rng_differs_p0.0"]["error"] is None for r in faults), faults
    assert faults[0]["rng_differs_p0.0"]["loss"] == faults[1]["rng_differs_p0.0"]["loss"]
    # Python's random module: a draw Dynamo hands the graph as an input (once silently each rank's own).
    for r in faults:
        _error(
            r["python_rng_apart"],
            "RandomStateMismatch",
            r"hold different Python random module states \(rank 0 / rank 1; global ranks\)",
            r"a call of Python's random module",
            r"random\.seed\(seed \+ dp_rank\)",
        )
        assert r["python_rng_alike"]["loss"] == pytest.approx(r["python_rng_eager"], rel=1e-5), r
    # Drawn in eager code (NumPy, a compiler.disable'd torch draw): no graph shows the draw, so the
    # ranks once each dropped their own positions, silently. Refused after the call; alike, exact.
    for draw, generator in (("numpy", "NumPy global random"), ("torch", "cpu random number generator")):
        for r in faults:
            _error(
                r[f"eager_{draw}_rng_apart"],
                "RandomStateMismatch",
                rf"hold different {generator} states \(rank 0 / rank 1; global ranks\)",
                r"this call, in code that runs outside the compiled graphs",
                r"transformers\.set_seed",
            )
            assert r[f"eager_{draw}_rng_alike"]["loss"] == pytest.approx(r[f"eager_{draw}_rng_eager"], rel=1e-5), r
    # Seeded alike, with dropout p=0.5: the masks are the single-device program's, so values and gradients match.
    for r in faults:
        sp, ref = r["rng_alike_vs_eager"]["loss"]
        assert abs(sp - ref) < 1e-6 and r["rng_alike_vs_eager"]["grad"] < 1e-5, r["rng_alike_vs_eager"]


def test_a_graph_that_fails_to_compile_on_one_rank_fails_on_every_rank(faults):
    r0, r1 = faults
    for stage in ("backward", "forward"):
        got, own = r0[f"compile_fails_{stage}"], r1[f"compile_fails_{stage}"]
        _error(
            got,
            "CompileFailed",
            r"compiled on this rank \(global rank 0\) but not on every SP rank",
            # The suite runs with CompiledWhole as an error (spmd_pool.fallback_is_an_error): rank 1 does
            # not fall back to torch (test_compiled_whole.py has that) but raises CompileCrashed.
            rf"global rank 1: CompileCrashed: AutoSP failed to compile graph \S+ \(RuntimeError: injected: the "
            rf"{stage} graph does not compile on rank 1",
            "no rank runs it",
        )
        # Agreed when the compile ends, not after the peer's collective timeout (120 s here).
        assert got["seconds"] < FAST_S * 2, got
        assert f"injected: the {stage} graph does not compile on rank 1" in own["message"], own
        assert own["error"] == "CompileCrashed", own
    # The ranks are still in step: the same program compiles again and runs.
    assert r0["after_compile_failure"]["error"] is None, r0["after_compile_failure"]
    assert r0["after_compile_failure"]["loss"] == r1["after_compile_failure"]["loss"]


@pytest.mark.extended(covered_by="integration_tests/test_faults.py::test_timeout_reaches_subgroups_made_without_one")
def test_rank_that_raises_and_stays_alive():
    (r0, r1) = run_spmd(guards_workers.rank_raises, 2, TIMEOUT_S, fresh=True)
    assert r0["group_timeouts"] == r1["group_timeouts"] == [120.0, TIMEOUT_S]
    assert set(r1) == {"group_timeouts"}
    for key, where in (("check", "the input check"), ("program", "a collective of the SP program")):
        msg = _error(
            r0[key],
            "CollectiveFailure",
            rf"global rank 0: {where}",
            r"global ranks \[0, 1\]",
            rf"within the group's timeout \({TIMEOUT_S:g} s\)",
            r"raised an error, exited or hangs",
        )
        assert "Timed out" in msg
        # Bounded by the SP group's timeout, not gloo's 30 minutes.
        assert TIMEOUT_S * 0.9 <= r0[key]["seconds"] < TIMEOUT_S + FAST_S, r0[key]
    # A backward fails within the timeout too, at its first collective (the step check).
    back = r0["backward"]
    _error(back, "CollectiveFailure", r"global rank 0: the backward's step check", r"raised an error, exited or hangs")
    assert TIMEOUT_S * 0.9 <= back["seconds"] < TIMEOUT_S + FAST_S, back


def test_ranks_whose_steps_part_are_refused_at_once():
    r0, r1 = run_spmd(guards_workers.steps_apart, 2, fresh=True)
    for r in (r0, r1):
        assert r["first"]["error"] is None, r["first"]
    assert r0["extra"]["error"] is None  # the extra forward itself pairs with rank 1's next forward
    # Rank 0's next forward meets rank 1's backward: both refuse in the same all-gather.
    expected = r"global ranks \[1\] are in its backward while global ranks \[0\] called it"
    for r in (r0, r1):
        _error(r["extra_next"], "StepMismatch", expected, r"Evaluate on every rank")
        assert r["extra_next"]["seconds"] < FAST_S, r["extra_next"]
    # Rank 1 skips a backward: rank 0's backward meets rank 1's next forward.
    for r in (r0, r1):
        _error(r["skip"], "StepMismatch", r"global ranks \[0\] are in its backward while global ranks \[1\]")
        assert r["skip"]["seconds"] < FAST_S, r["skip"]
        assert r["after"]["error"] is None, r["after"]
    assert r0["after"]["loss"] == r1["after"]["loss"] == pytest.approx(r0["first_loss"], rel=1e-6)


def test_ranks_backpropagating_different_gradients_are_refused():
    for r in run_spmd(guards_workers.gradients_apart, 2, fresh=True):
        for key in ("scaled", "scaled_by_hook", "labels_apart"):
            _error(
                r[key],
                "GradientMismatch",
                r"differs between the SP ranks \(global ranks \[0\] / global ranks \[1\]\)",
                r"scaled alike",
            )
            assert r[key]["seconds"] < FAST_S, r[key]
        assert r["labels_alike"]["error"] is None, r["labels_alike"]
        assert r["labels_alike_grad"] < 1e-6, r


@pytest.mark.extended(
    covered_by="packages/autosp-core/tests/test_weak_group.py::test_a_live_object_of_a_destroyed_default_group_is_refused"
)
def test_groups_are_not_kept_alive_past_destroy_process_group():
    # A group kept alive past destroy_process_group is torn down at interpreter exit, where gloo
    # can abort the process; and a call after it must say what happened.
    for rank, r in enumerate(run_spmd(guards_workers.groups_after_destroy, 4, fresh=True)):
        assert r["groups"] >= 4 and r["alive"] == 0, (rank, r)  # hybrid's 2, dp x sp's 1, the user's 1
        for name in ("hybrid", "dp_x_sp", "user_group"):
            _error(r[name], "ConfigError", r"was destroyed \(torch.distributed.destroy_process_group\)", "compile")


def test_programs_that_differ_between_ranks_are_refused(faults):
    # A module attribute (baked into the graph by Dynamo) that differs per rank: each rank would run
    # its own program, the collectives of one paired with the other's (once a silently wrong loss).
    messages = {
        _error(
            r["program_differs"],
            "ProgramMismatch",
            r"compiled different programs for graph \[\d+/\d+\] \(global ranks \[0\]; global ranks \[1\]\)",
            r"the first difference: '.*1\.0.*' on global ranks \[0\] against '.*2\.0.*' on global ranks \[1\]",
            r"module attributes and train\(\)/eval\(\) mode",
        )
        for r in faults
    }
    assert len(messages) == 1
    assert all(r["program_differs"]["seconds"] < FAST_S for r in faults)
    # Changed on one rank after the first call: the rank that recompiles and the one that runs the
    # first graph meet in the same exchange, and both refuse at once.
    assert {r["changed_first"]["loss"] for r in faults} == {faults[0]["changed_first"]["loss"]}
    for r in faults:
        _error(r["changed_later"], "ProgramMismatch", r"global ranks \[0\]; global ranks \[1\]")
        assert r["changed_later"]["seconds"] < FAST_S, r["changed_later"]
    # A hook registered after the first call (once silently skipped): on every rank it runs, as
    # in eager; on one rank only, the programs differ and both ranks refuse at once.
    for r in faults:
        assert r["hook_first"]["error"] is None, r["hook_first"]
        assert r["hook_everywhere"]["error"] is None, r["hook_everywhere"]
        assert r["hook_everywhere"]["loss"] == pytest.approx(r["hook_reference"], rel=1e-5)
        assert r["hook_everywhere"]["loss"] != pytest.approx(r["hook_first"]["loss"], rel=1e-3)
        _error(r["hook_one_rank"], "ProgramMismatch", r"global ranks \[0\]; global ranks \[1\]")
        assert r["hook_one_rank"]["seconds"] < FAST_S, r["hook_one_rank"]
    # Tensors read besides parameters, buffers and inputs (a plain attribute, a global): compared at
    # a graph's first run and at every run after (once silently each rank's own).
    for r in faults:
        _error(
            r["attribute_apart"],
            "ParameterMismatch",
            r"hold different tensors, 1 of 2 that graph",
            r"  table: rank 0 / rank 1",
        )
        assert r["attribute_alike"]["error"] is None
        assert r["attribute_alike"]["loss"] == pytest.approx(r["attribute_reference"], rel=1e-5)
        _error(
            r["attribute_filled"],
            "ParameterMismatch",
            r"besides parameters, buffers and inputs",
            r"  table: rank 0 / rank 1",
        )
        _error(r["global_filled"], "ParameterMismatch", r"  GLOBAL_SCALE \(a global\): rank 0 / rank 1")
        assert r["attribute_agree_again"]["loss"] == r["attribute_alike"]["loss"]
        # A local crossing a graph break is the call's own value, not a captured tensor.
        assert r["empty_across_break"]["error"] is None, r["empty_across_break"]
        assert r["empty_across_break"]["loss"] == pytest.approx(r["empty_across_break_reference"], rel=1e-5)
        for key in ("attribute_apart", "attribute_filled", "global_filled"):
            assert r[key]["seconds"] < FAST_S, r[key]
    # A hook that only records, on one rank: the same program recompiled there; every rank runs on.
    for rank, r in enumerate(faults):
        assert [x["error"] for x in r["record_one_rank"]] == [None, None], r["record_one_rank"]
        assert {x["loss"] for x in r["record_one_rank"]} == {r["record_first"]["loss"]}
        assert all(x["seconds"] < FAST_S for x in r["record_one_rank"]), r["record_one_rank"]
        assert r["recorded"] == ([(2, 32, 48)] * 2 if rank == 0 else [])
    # The same through a settings object passed in: its attributes are compared with the inputs.
    for r in faults:
        _error(
            r["settings_differ"],
            "InputMismatch",
            r"settings\.scale: rank 0: float 1\.0; rank 1: float 2\.0",
        )
        # One rank under no_grad: the grad mode is compared too (Dynamo compiles another graph for it).
        _error(
            r["grad_mode_differs"],
            "InputMismatch",
            r"\(grad mode\): rank 0: enabled True; rank 1: enabled False",
            r"the same torch\.no_grad\(\)/autocast context",
        )
        _error(
            r["inference_mode_differs"],
            "InputMismatch",
            r"\(grad mode\): rank 0: enabled False; rank 1: enabled False, inference mode",
        )
        _error(
            r["sharded_across_break"], "AutoSPError", r"outputs='sharded' an output of one graph crossed a graph break"
        )


@pytest.mark.parametrize(
    "variant",
    [
        "ulysses",
        pytest.param(
            "ring", marks=pytest.mark.extended(covered_by="test_a_rank_whose_program_raises_fails_its_peers_at_once")
        ),
    ],
)  # all-to-alls; ring's hops
def test_a_rank_whose_program_raises_fails_its_peers_at_once(variant):
    r0, r1 = run_spmd(guards_workers.peer_fails_in_program, 2, variant, fresh=True)
    for r in (r0, r1):
        assert r["good"]["error"] is None, r["good"]
        # Every rank raised at the same point and went on: still in step, their notes stale.
        assert r["everywhere"]["error"] == "IndexError", r["everywhere"]
        assert r["after"]["error"] is None and r["after"]["loss"] == r["good"]["loss"], r["after"]
    # A rank that raised alone, after the last collective, and came back is in step again.
    assert r1["eval"][1]["error"] == "ValueError", r1["eval"]
    for r in (r0, r1):
        assert [e["error"] for e in r["eval"][2:]] == [None, None], r["eval"]
        assert {e["loss"] for e in r["eval"][2:]} == {r0["eval"][0]["loss"]}, r["eval"]
    assert r0["eval"][3]["seconds"] > 2.5  # it waited past the grace with no note left standing
    assert r1["one"]["error"] == "IndexError", r1["one"]
    _error(
        r0["one"],
        "PeerFailed",
        r"global rank 0: global rank 1 of the SP group raised IndexError: index out of range in self",
        r"can never complete",
        r"end the job on every rank",
    )
    # Within the grace (2 s), not at the group's timeout (120 s).
    assert r0["one"]["seconds"] < FAST_S, r0["one"]


@pytest.mark.parametrize(
    ("backend", "leaves"),
    [
        ("aot_eager", False),
        pytest.param(
            "inductor",
            False,
            marks=pytest.mark.extended(covered_by="test_a_rank_whose_backward_raises_fails_its_peers_at_once"),
        ),
        pytest.param(
            "aot_eager",
            True,
            marks=pytest.mark.extended(covered_by="test_a_rank_whose_backward_raises_fails_its_peers_at_once"),
        ),
    ],
)
def test_a_rank_whose_backward_raises_fails_its_peers_at_once(backend, leaves):
    r0, r1 = run_spmd(guards_workers.peer_fails_in_backward, 2, backend, leaves, fresh=True)
    assert r0["good"]["error"] is None and r1["good"]["error"] is None, (r0, r1)
    assert r1["bad"]["error"] == "ValueError", r1["bad"]
    error = re.escape("global rank 1: ValueError: a rank-local error in the backward")
    if leaves:
        _error(r0["bad"], "CollectiveFailure", "a collective of the SP program's backward did not complete", error)
    else:
        _error(r0["bad"], "PeerFailed", r"global rank 1 of the SP group raised ValueError: a rank-local error")
    # Before: the group's timeout (120 s here), then gloo's own words.
    assert r0["bad"]["seconds"] < FAST_S, r0["bad"]


@pytest.mark.extended(covered_by="test_a_rank_whose_program_raises_fails_its_peers_at_once")
def test_a_failure_reaches_ranks_that_share_no_group_with_the_failed_rank():
    results = run_spmd(guards_workers.peer_fails_in_hybrid, 4, fresh=True)
    assert all(r["good"]["error"] is None for r in results), results
    assert results[3]["bad"]["error"] == "IndexError", results[3]
    for rank, r in enumerate(results[:3]):
        _error(r["bad"], "PeerFailed", rf"global rank {rank}: global rank 3 of the SP group raised IndexError")
        assert r["bad"]["seconds"] < FAST_S, (rank, r["bad"])  # before: rank 0 waited for the timeout
    assert "relayed" in results[0]["bad"]["message"], results[0]


def test_a_failed_rank_that_left_is_named_with_its_error():
    r0, _ = run_spmd(guards_workers.failed_rank_leaves, 2, fresh=True)
    _error(
        r0["after"],
        "CollectiveFailure",
        r"Connection closed by peer",
        re.escape("it raised an error (global rank 1: IndexError: index out of range in self), exited or hangs"),
    )


def test_a_rank_calling_alone_hears_which_peer_has_not_called_then_fails_at_the_timeout():
    # Evaluation on rank 0 only, with the compiled model: rank 0 waits in the input check for a peer
    # that never comes. Before the group's timeout a warning names the peer and the calls each began.
    timeout, warn_after = 6.0, 1.0
    r0, _ = run_spmd(guards_workers.calls_alone, 2, timeout, warn_after, fresh=True)
    not_begun = (
        "Global rank(s) 1 have not begun this call (calls of the compiled program begun so far: global rank 1 1, "
    )
    not_begun += "this rank 2)."
    (late,) = r0["late"]
    assert "global rank 0 has waited " in late and "for the other ranks of its group (global ranks [0, 1])" in late
    assert not_begun in late and "call the uncompiled model there" in late, late
    assert "this rank fails at the group's timeout (6 s)" in late, late
    msg = _error(
        r0["alone"],
        "CollectiveFailure",
        r"the input check \(the first collective of every call\) did not complete",
        re.escape(not_begun),
    )
    assert timeout <= r0["alone"]["seconds"] < timeout + FAST_S, (r0["alone"]["seconds"], msg)
