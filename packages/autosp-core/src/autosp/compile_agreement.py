"""The SP ranks agree that each graph compiled before any rank runs it.

Each rank compiles its own graph, and the graphs differ in rank-dependent sizes, so a compile can
fail on one rank only (Inductor's schedule check, a rank whose piece is empty). Left alone, that
rank raises while its peers run the graph and wait in its first collective until the group's
timeout: a hang, its cause only in another process's log. So every compile of an SP graph ends
with one all-reduce of "did it fail" over the SP ranks, and if any rank failed, every rank raises:
the failed ones their own error, the others ``CompileFailed`` with the failed ranks' first lines.

The same all-reduce compares a digest of what each rank compiles: the Dynamo graph (the same on
every rank, which traced the same full-length inputs, up to the order of its trace: the digest is of
the canonical form every rank compiles, ``autosp.canonical``) and the options. Ranks whose programs differ
(a module attribute that steers control flow, one rank in ``eval()`` with dropout, another head
count or causal flag, other ``autosp.compile`` options) would pair collectives of different programs:
a loss that matches no single-device run, or a hang. Every rank raises ``ProgramMismatch`` instead.

The same all-reduce compares, last, the group ops each rank's compiled forward and backward issue,
in order (``Report.group_ops``). The SP rewrite emits the same ones on every rank, and the passes
after it (the partitioner's CSE and dead-code removal, Inductor's scheduler) are held to keep them
(``autosp.passes.collective_order``); ranks whose sequences still differ would hang in their first
unpaired collective, or pair two collectives of one kind and size silently. So every rank raises
``CollectiveMismatch`` instead, naming the first difference: a bug in AutoSP, never the user's.
SP graphs never come from AOT autograd's cache (``AutoSPBackend._compile_once``), whose hits would
skip the partition and so bring no sequence to compare. Ranks whose recomputed collectives (SAC)
parted are compiled again without recompute (``AutoSPBackend._compile``).

Ranks running a graph begin each run with the same all-reduce (``SameProgramOnEveryRun``), so when
Dynamo recompiles on some ranks only, the compiling ranks' agreement meets the running ranks' run
exchange: programs that differ are refused there, and an identical one (a hook that only records,
registered on one rank) lets every rank go on in step, the compiling ranks skipping the run
exchange their agreement already took.

The all-reduce runs on the compile-sync group when ``timeout=`` made one (the SP ranks with the
world's timeout), so a rank that compiles slower never trips the SP group's short timeout; that
is also why the backward compiles with the forward under SP (``force_non_lazy_backward_lowering``):
its compile, and its failures, then happen here too, not in a backward the peers already run.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosp import peer_failure
from autosp.analysis.attention import hint, hints
from autosp.canonical import program_code
from autosp.errors import AutoSPError, first_line
from autosp.guards import CollectiveFailure, comm_failure_message, is_comm_failure
from autosp.input_check import collective_device
from autosp.param_check import ParameterMismatch, mismatch_message
from autosp.rng_check import digest_bytes
from autosp.sample_digest import sample_fingerprints
from autosp.weak_group import WeakGroup

T = TypeVar("T")


class CompileFailed(AutoSPError):
    """Another SP rank failed to compile a graph this rank compiled; no rank runs it."""


class ProgramMismatch(AutoSPError):
    """The SP ranks compiled different programs (graphs or options) for the same call."""


class CollectiveMismatch(AutoSPError):
    """The SP ranks compiled one program into different sequences of collectives (an AutoSP bug)."""


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_UNCOMPARED = ("group", "timeout", "hardware")  # process objects, and settings that cannot part the programs
_MASK = (1 << 62) - 1  # a digest d and -d both fit int64, so one MAX all-reduce gives min and max


def program_text(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Any, lowered: str | None = None
) -> str:
    """What the SP ranks must agree on for one compile: the Dynamo graph, its inputs' shapes, the options.

    ``lowered``: the lowered graph in canonical form (``Report.lowered``); with it, the graph is
    compared in a form that does not depend on the order of the trace (``autosp.canonical``).
    """
    inputs = [
        f"{hints(x.shape)} {x.dtype} {x.requires_grad}" if isinstance(x, torch.Tensor) else repr(hint(x))
        for x in example_inputs
    ]
    opts = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in _UNCOMPARED}
    # The inputs first: when they differ (torch.compile with autosp.backend checks them only inside the
    # graph, after Dynamo compiled), that is the first difference the message shows.
    # Subgraphs too (checkpointed layers, a custom Function's forward and backward, Flex's score_mod):
    # a constant that differs between ranks may sit in one of them only.
    code = program_code(gm, lowered)
    return _ADDRESS.sub("0x..", f"graph inputs: {inputs}\noptions: {opts!r}\n{code}")


def agree_on_compile(
    compile_fn: Callable[[], T],
    group: Any,
    what: str,
    program: str | Callable[[], str] = "",
    group_ops: Callable[[], list[str] | None] = lambda: None,
) -> T:
    """``compile_fn()`` on this rank; it returns only if it returned on every rank of ``group``, and
    every rank compiled the same ``program`` (``program_text``) into the same ``group_ops()``."""
    return agree_on_compile_joining_runs(compile_fn, group, what, program, group_ops=group_ops)[0]


def agree_on_compile_joining_runs(
    compile_fn: Callable[[], T],
    group: Any,
    what: str,
    program: str | Callable[[], str] = "",
    captured: Sequence[tuple[str, int]] = (),
    group_ops: Callable[[], list[str] | None] = lambda: None,
) -> tuple[T, bool]:
    """``agree_on_compile``, and whether ranks running a graph (``SameProgramOnEveryRun``) met this
    exchange: Dynamo recompiled on some ranks only, into the same program. Those ranks then run
    their graph's collectives; this rank, which took their run exchange here, must skip its own
    first one (``SameProgramOnEveryRun(skip_first=True)``) to stay in step with them.
    ``captured``: fingerprints of the tensors the graph reads besides parameters and inputs
    (``CapturedDigest``), which the running ranks' exchange carries too. ``group_ops``: the compiled
    graphs' group ops, read once ``compile_fn`` returned (None: not known on this rank); ``program``
    may be read then too (the lowered graph's canonical form is known only after the compile)."""
    error: Exception | None = None
    result: Any = None
    try:
        result = compile_fn()
    except Exception as e:  # a KeyboardInterrupt is not a compile failure: it ends this rank
        error = e
    waiting = f"waiting for every SP rank to compile {what}"
    sequence = group_ops() if error is None else None
    program = program() if callable(program) else program
    failed, alike, running = _exchange(
        group, waiting, what, program, error, CapturedDigest.digest(captured), compiling=True, sequence=sequence
    )
    if failed == 0 and not alike:
        _refuse_other_tensors(group, what, captured)
    if failed == 0:
        return result, running
    lines: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, None if error is None else first_line(error), group=group)
    if error is not None:
        raise error
    raise _compile_failed(what, group, lines, "compiled on this rank")


def _compile_failed(what: str, group: Any, lines: list[Any], here: str) -> CompileFailed:
    ranks = dist.get_process_group_ranks(group)
    failures = "; ".join(f"global rank {ranks[i]}: {line}" for i, line in enumerate(lines) if line is not None)
    return CompileFailed(
        f"{what} {here} (global rank {dist.get_rank()}) but not on every SP rank ({failures}), "
        "so no rank runs it: its collectives need every SP rank. The failed rank's log holds the whole error."
    )


def _program_digest(program: str) -> int:
    return digest_bytes(program.encode()) & _MASK


def _exchange(
    group: Any,
    waiting: str,
    what: str,
    program: str,
    error: Exception | None,
    captured: int = 0,
    compiling: bool = False,
    sequence: list[str] | None = None,
    digest: int | None = None,
) -> tuple[int, bool, bool]:
    """One MAX all-reduce of (failed?, digest, -digest, captured, -captured, compiling, -compiling,
    sequence unknown?, its digest, -digest); raises ``ProgramMismatch`` when the program digests
    differ, ``CollectiveMismatch`` when every rank knows its group ops and they differ. Returns (ranks
    that failed, whether the ``captured`` digests agree, whether some ranks were compiling and others
    running). ``digest``: the program's, when the caller keeps it (a graph runs many times)."""
    digest = _program_digest(program) if digest is None else digest
    captured &= _MASK
    ops = digest_bytes("\n".join(sequence).encode()) & _MASK if sequence is not None else 0
    values = [int(error is not None), digest, -digest, captured, -captured, int(compiling), -int(compiling)]
    values += [int(sequence is None), ops, -ops]
    agreed = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    try:
        peer_failure.wait(
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True), group, agreed.device
        )
    except Exception as e:
        if is_comm_failure(e):
            raise CollectiveFailure(comm_failure_message(waiting, group, e)) from (error or e)
        raise
    failed, highest, lowest, captured_high, captured_low, any_compiling, not_all, unknown, ops_high, ops_low = (
        int(v) for v in agreed.tolist()
    )
    if failed == 0 and highest != -lowest:
        _refuse_other_programs(group, what, program, error)
    if failed == 0 and unknown == 0 and ops_high != -ops_low:
        assert sequence is not None  # every rank knows its sequence
        _refuse_other_sequences(group, what, sequence)
    return failed, captured_high == -captured_low, any_compiling == 1 and not_all == 0


class SameProgramOnEveryRun:
    """A compiled graph that first exchanges its program's digest, in the compile agreement's collective.

    When Dynamo's guards fail on some ranks only (an attribute changed on one rank after the first
    call), those ranks compile and wait in the agreement while the others would run the old graph:
    this exchange, on the SP group, pairs with the agreement's (which runs there too unless
    ``timeout=`` made a compile-sync group), so every rank sees the programs differ and raises,
    instead of the ones running waiting in a collective until the timeout.

    The same exchange compares the tensors the graph reads that are neither parameters, buffers nor
    the call's inputs (``captured``: plain tensor attributes of a module, globals): nothing else
    does, and ranks holding different ones would each run another program's numbers, silently.
    """

    group = WeakGroup()

    def __init__(
        self,
        fn: Callable[..., Any],
        group: Any,
        what: str,
        program: str,
        captured: CapturedDigest | None = None,
        skip_first: bool = False,
    ) -> None:
        self.fn, self.group, self.what, self.program = fn, group, what, program
        # Once, not at every run: a large model's text is megabytes (12 ms to hash 2.8 MB here).
        self.digest = _program_digest(program)
        self.captured = captured if captured is not None else CapturedDigest(())
        self.skip = skip_first  # this rank's compile agreement already took the running ranks' exchange
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        if self.skip:
            self.skip = False
            return self.fn(*args)
        waiting = f"a collective of the SP program (the check that every SP rank runs {self.what})"
        named = self.captured.fingerprints(args)
        failed, alike, _ = _exchange(
            self.group, waiting, self.what, self.program, None, self.captured.digest(named), digest=self.digest
        )
        if failed:
            # A rank that recompiled this graph failed: join its report, as the compiling ranks do.
            lines: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(lines, None, group=self.group)
            raise _compile_failed(self.what, self.group, lines, "runs on this rank")
        if not alike:
            _refuse_other_tensors(self.group, self.what, named)
        return self.fn(*args)


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _refuse_other_sequences(group: Any, what: str, sequence: list[str]) -> None:
    """Every rank saw the group-op digests differ: name the first op where two ranks part."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sequence, group=group)
    ranks = dist.get_process_group_ranks(group)
    first = gathered[0]
    other = next(i for i, seq in enumerate(gathered) if seq != first)
    at = _first_difference(first, gathered[other])
    show = lambda seq: seq[at] if at < len(seq) else "(no more)"  # noqa: E731
    raise CollectiveMismatch(
        f"the SP ranks compiled {what} into different sequences of collectives: global rank {ranks[0]} issues "
        f"{len(first)}, global rank {ranks[other]} {len(gathered[other])}; at position {at} "
        f"{show(first)!r} against {show(gathered[other])!r}. Run, the ranks would wait in a collective another "
        "never issues, or pair two that sum the wrong tensors. This is a bug in AutoSP, not in your program: please "
        "report it with this message and the graph's report (compiled.autosp_reports); backend='aot_eager' or "
        "sac=False may avoid it meanwhile."
    )


def _refuse_other_tensors(group: Any, what: str, named: Sequence[tuple[str, int]]) -> None:
    """Every rank saw the captured digests differ: name the tensors and which ranks hold what."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(named), group=group)
    ranks = dist.get_process_group_ranks(group)
    holder = f"that {what} reads besides parameters, buffers and inputs (plain tensor attributes, globals)"
    raise ParameterMismatch(mismatch_message(gathered, ranks, holder, kind="tensors"))


class CapturedDigest:
    """Sample fingerprints of the graph inputs at ``captured`` ((index, name) pairs), read afresh at each run."""

    def __init__(self, captured: Sequence[tuple[int, str]]) -> None:
        self.captured = list(captured)

    @staticmethod
    def digest(named: Sequence[tuple[str, int]]) -> int:
        return digest_bytes(repr(named).encode()) if named else 0

    def fingerprints(self, args: Sequence[Any]) -> list[tuple[str, int]]:
        fps = sample_fingerprints([args[i] for i, _ in self.captured])
        return [(name, fp) for (_, name), fp in zip(self.captured, fps)]


def string_hash() -> int:
    """This process's hash of a fixed string: it differs between processes unless PYTHONHASHSEED is set."""
    return hash("autosp")


_HASH_HINT = (
    " The ranks' Python string hashes differ (PYTHONHASHSEED is not set alike), so a loop over a set of "
    "strings (HF Gemma-3 has one, over its layer types) runs in another order on each rank. AutoSP compiles "
    "work traced in another order as one program, but not random draws or writes made in another order, nor "
    "a graph break inside such a loop (each rank then compiles its pieces in another order). Launch every "
    "rank with the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0 torchrun ...)."
)


# Ends the program text of a graph that AutoSP failed to compile and torch compiled whole (autosp.whole).
WHOLE_MARK = "\ncompiled whole by torch"


def _refuse_other_programs(group: Any, what: str, program: str, error: Exception | None) -> None:
    """Every rank saw the digests differ: name which ranks compiled which program, and the first difference."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (program, string_hash()), group=group)
    texts = [text for text, _ in gathered]
    hashes_differ = len({h for _, h in gathered}) > 1
    ranks = dist.get_process_group_ranks(group)
    whole = [r for r, text in zip(ranks, texts) if text.endswith(WHOLE_MARK)]
    if whole:
        # One program, which AutoSP failed to compile on some ranks only (a rank-dependent size).
        raise CompileFailed(
            f"AutoSP failed to compile {what} on global ranks {whole} (their CompiledWhole warning says why) and "
            f"compiled it on global ranks {[r for r in ranks if r not in whole]}: run whole on some ranks and "
            "sequence-parallel on the others, it would pair no collectives, so no rank runs it. Please report "
            "this with the program; sp_size=1 runs it."
        ) from error
    variants: dict[str, list[int]] = {}
    for rank, text in zip(ranks, texts):
        variants.setdefault(text, []).append(rank)
    first, *others = list(variants)
    a, b = first.splitlines(), others[0].splitlines()
    line = _first_difference(a, b)
    show = lambda lines: lines[line].strip()[:400] if line < len(lines) else "(nothing)"  # noqa: E731
    groups = "; ".join(f"global ranks {rs}" for rs in variants.values())
    raise ProgramMismatch(
        f"the SP ranks compiled different programs for {what} ({groups}); the first difference: "
        f"{show(a)!r} on global ranks {variants[first]} against {show(b)!r} on global ranks {variants[others[0]]}. "
        "Run them, and they would pair collectives of different programs: a result that matches no "
        "single-device run, or a hang. Every SP rank must run the same model code in the same state: the same "
        "module attributes and train()/eval() mode, the same torch.no_grad()/autocast context and the same "
        "autosp.compile options, called with the same inputs." + (_HASH_HINT if hashes_differ else "")
    ) from error


__all__ = [
    "WHOLE_MARK",
    "CapturedDigest",
    "CollectiveMismatch",
    "CompileFailed",
    "ProgramMismatch",
    "SameProgramOnEveryRun",
    "agree_on_compile",
    "agree_on_compile_joining_runs",
    "program_text",
]
