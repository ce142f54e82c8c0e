"""A rank whose SP program raises tells the other ranks within seconds, through the process group's store.

Without it, an error on some ranks only (a token id outside the embedding's range, in the tokens
of one rank; a label out of range; memory running out on one rank) leaves the other ranks in
their next collective, which the failed rank never joins, until the group's timeout: gloo's
default is 30 minutes, a hang to whoever runs the job, and the failed rank may stay alive that
long (saving a checkpoint, a caught error) without its peers learning why.

* ``announce``: a rank whose compiled program raised writes a note in the default store, under
  ``autosp/failed/<global rank>``: how many of AutoSP's collectives it had waited for on each of
  its groups (the SP group, hybrid's subgroups, the compile agreement's), and its error's first line.
  A rank that raises ``PeerFailed`` passes the cause on in a note of its own: hybrid's ranks that
  share no subgroup with the failed rank wait on it.
* ``wait``: AutoSP waits for each of its collectives on a CPU (gloo) group in slices of
  ``POLL``; a wait that outlasts a slice reads the peers' notes and raises ``PeerFailed``, naming
  the failed rank and its error, once a note that counts has stood for ``GRACE_S`` with the
  collective still waiting. A wait that completes within its first slice costs nothing more; a
  longer one reads one key of the store per slice (how many notes were ever written) until there
  is a note.
* A wait that outlasts ``WAIT_WARN_S`` with no note warns once (``PeersLate``), naming the peers
  that have not begun the call this rank is in (``autosp.arrivals``): a rank that evaluates alone
  with the compiled model, its peers busy elsewhere, otherwise waits silently until the timeout.
* A note counts unless this rank failed itself after the same number of collectives: ranks that
  raised at the same point (a bad batch on every rank, caught and skipped on every rank) are
  still in step, and their notes are stale. A rank whose collective completes again is back in
  step and deletes its note; the grace covers its way back (its error caught, logged).

Announced: errors of a compiled graph's forward, of its backward (wrapped on AOT autograd's
class for the graph, ``announce_backward_of``: autograd's engine hands the error straight to
whoever called ``.backward()``), and of code Dynamo runs between graphs (``guards.GuardedCall``).
Not announced: errors in the user's code outside the compiled program (a hook on a parameter's
gradient), where the rank is not in the program at all.

Not polled, so ending at the group's timeout as before: CUDA collectives (their wait orders
streams without blocking the host, and a wait with a timeout would block it) and gloo's
point-to-point sends and receives (a timed wait that ends first closes the pair: ring's hops on
gloo are all-to-alls for this).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autosp import arrivals
from autosp.errors import CollectiveFailure, PeerFailed

# gloo's words for a peer that is gone or late; "pair closure" is what a group says on every later
# collective once one of its operations timed out (the group is dead: compile the program again).
_COMM_FAILURES = (
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Application timeout caused pair closure",
)
POLL = timedelta(milliseconds=100)
GRACE_S = 2.0  # how long a note must stand, the collective still waiting, before it counts
# A first compile or a checkpoint saved on one rank can keep the others waiting for a minute; far
# longer than a step, and the user should hear why before the group's timeout (30 minutes in gloo).
WAIT_WARN_S = 120.0
_POLL_TIMED_OUT = "Operation timed out!"  # c10d's Work.wait(timeout) when the slice ends first
_WRITTEN = "autosp/failed/count"  # notes ever written: a waiting rank reads one key until there is one

_waited: dict[str, int] = {}  # group name -> collectives waited for on it by this process
_failed_at: dict[str, set[int]] = {}  # group name -> the counts at which this rank raised
_noted = False  # this rank's note is in the store


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed for want of a peer (gloo raises a plain RuntimeError)."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _COMM_FAILURES)


class PeersLate(UserWarning):
    """A rank has waited long in a collective of AutoSP's program for peers that have not joined it."""


def _key(rank: int) -> str:
    return f"autosp/failed/{rank}"


_store = arrivals.default_store


def _polls(group: Any, device: torch.device) -> bool:
    # Not cached by name: a group made after destroy_process_group can take a destroyed one's name.
    return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def wait(work: Any, group: Any, device: torch.device) -> None:
    """``work.wait()``, raising ``PeerFailed`` when a peer announced an error it does not come back from."""
    global _noted
    name = group.group_name
    _waited[name] = _waited.get(name, 0) + 1
    if not _polls(group, device):
        work.wait()
    else:
        _wait_polling(work, group)
    if _noted:
        # A collective completed with its peers: this rank is back in step, its note is stale.
        _noted = False
        store = _store()
        try:
            if store is not None:
                store.delete_key(_key(dist.get_rank()))
        except Exception:  # the store went with a rank that exited: the next collective says so
            pass


def _wait_polling(work: Any, group: Any) -> None:
    noticed: float | None = None
    started, warned = time.monotonic(), False
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError as e:
            # Only the slice's end says this; a work that completed since waits no more next time,
            # and one that failed raises its own error then (a peer gone, the group's timeout).
            if _POLL_TIMED_OUT not in str(e):
                raise
        failure = peer_note(group)
        if failure is None:
            noticed = None
            if not warned and time.monotonic() - started >= WAIT_WARN_S:
                warned = True
                warnings.warn(late_message(group, time.monotonic() - started), PeersLate, stacklevel=2)
            continue
        # A rank that raised and goes on (its error caught) takes a moment to come back; one that
        # does not leaves its note in place.
        noticed = time.monotonic() if noticed is None else noticed
        if time.monotonic() - noticed >= GRACE_S:
            origin, error, via = failure
            # Passed on: ranks that share a group with this one but not with the failed rank
            # (hybrid's other subgroups) wait on this rank now.
            _write(f"{_counts(_waited)}\n{origin}\n{error}")
            me = dist.get_rank()
            if origin == me:  # it came back too late: the others gave up on it
                cause = f"this rank raised {error} earlier and did not come back within {GRACE_S:g} s"
            else:
                relayed = f" (as global rank {via} relayed)" if via != origin else ""
                cause = f"global rank {origin} of the SP group raised {error}{relayed}"
            raise PeerFailed(
                f"global rank {me}: {cause}, so this rank's collective of the SP program can never complete. The "
                "failed rank's log holds its whole error; the SP group cannot be used after it: end the job on "
                "every rank, or fix the input that raised there."
            )


def late_message(group: Any, waited_s: float) -> str:
    """Why this rank, in a collective of ``group`` for ``waited_s``, still waits: which peers have not begun its call."""
    from autosp.options import timeout_phrase  # options imports input_check, which imports this module

    until = timeout_phrase(group)
    head = (
        f"global rank {dist.get_rank()} has waited {waited_s:.0f} s in a collective of AutoSP's compiled program "
        f"for the other ranks of its group (global ranks {dist.get_process_group_ranks(group)}). "
    )
    late = arrivals.behind(group)
    if late is None:
        return head + (
            "One of them is slow inside the call (compiling a new graph, a long step), busy elsewhere, or will not "
            f"call the compiled model at this step: then this rank fails at {until}. Every rank of the SP group must "
            "call it at every step."
        )
    if not late:
        return head + (
            "Each of them has begun this call too: one is slow inside it (compiling a new graph, a long step) or "
            f"waits in a collective of its own on this group. This rank fails at {until} if it never comes."
        )
    return head + (
        f"{arrivals.not_begun(late)} Every rank of the SP group must call the compiled model at every step: if "
        "they are busy elsewhere (saving a checkpoint, loading data), this wait ends when they call; if they will "
        f"not call it, this rank fails at {until}. Where only some ranks run the model (evaluation or logging on "
        "rank 0), call the uncompiled model there."
    )


def peer_note(group: Any) -> tuple[int, str, int] | None:
    """The first peer's failure that counts on ``group`` (see the module's docstring): the rank that
    raised, its error, and the peer whose note said so; or ``None``."""
    store = _store()
    if store is None:
        return None
    try:
        if store.add(_WRITTEN, 0) == 0:
            return None
    except Exception:  # the store went with a rank that exited: nothing to add
        return None
    for rank in dist.get_process_group_ranks(group):
        try:
            if rank == dist.get_rank() or not store.check([_key(rank)]):
                continue
            note = store.get(_key(rank)).decode(errors="replace")
        except Exception:  # the store went with a rank that exited: nothing to add
            return None
        failure = counting_error(note, group.group_name, _failed_at.get(group.group_name, set()))
        if failure is not None:
            return failure[0], failure[1], rank
    return None


def _counts(waited: dict[str, int]) -> str:
    return " ".join(f"{name}={count}" for name, count in waited.items())


def note_of(error: BaseException, waited: dict[str, int], rank: int) -> str | None:
    """What ``rank``, having raised ``error``, writes (``waited``: its collectives per group so far),
    or ``None`` for a rank that only failed for want of a peer (it passes on the cause it read)."""
    if isinstance(error, CollectiveFailure) or is_comm_failure(error):
        return None
    first = (str(error).strip().splitlines() or [""])[0][:300]
    what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return f"{_counts(waited)}\n{rank}\n{what}"


def counting_error(note: str, group_name: str, failed_at: set[int]) -> tuple[int, str] | None:
    """The rank and error a peer's ``note`` names when it counts on ``group_name``: unless this rank
    raised too after the same number of the group's collectives (``failed_at``), so both went on in step."""
    counts, origin, error = note.split("\n", 2)
    pairs = (entry.rpartition("=") for entry in counts.split(" ") if entry)
    count = {name: int(n) for name, _, n in pairs}.get(group_name, 0)
    return None if count in failed_at else (int(origin), error)


def _write(note: str) -> None:
    global _noted
    store = _store()
    if store is None:
        return
    try:
        store.set(_key(dist.get_rank()), note)
        store.add(_WRITTEN, 1)
        _noted = True
    except Exception:  # the store is gone too (the job is ending): the error itself still raises
        pass


def announce(error: BaseException) -> None:
    """Tell the ranks of this rank's groups that its program raised ``error`` (not a peer's failure)."""
    # Announced once: a graph's wrapper and the compiled call around it both see the same error.
    if not dist.is_initialized() or getattr(error, "_autosp_announced", False):
        return
    note = note_of(error, _waited, dist.get_rank())
    if note is None:
        return
    try:
        error._autosp_announced = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: announced again, harmlessly
        pass
    for name, count in _waited.items():
        _failed_at.setdefault(name, set()).add(count)
    _write(note)


def announcing(
    fn: Callable[..., Any], in_backward: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
) -> Callable[..., Any]:
    """``fn`` (a compiled graph's forward), announcing what it, and the backward it records, raise
    to the ranks of this rank's groups; the backward runs inside ``in_backward()`` (which can name
    its errors)."""
    backward_announces = False

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal backward_announces
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            announce(e)
            raise
        if not backward_announces:  # until a call records the graph's backward (not under no_grad)
            backward_announces = announce_backward_of(out, in_backward)
        return out

    return run


# How far from an output the graph's backward node can be: AOT autograd hands out views of its
# outputs (regenerated aliases), each a node or two in front of it.
_BACKWARD_SEARCH = 4


def announce_backward_of(
    out: Any, in_backward: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
) -> bool:
    """Have the compiled backward behind ``out`` announce what it raises; whether it was found.

    The backward runs inside autograd's engine, which hands its error to whoever called
    ``.backward()``: nothing of AutoSP's sees it there. AOT autograd's ``CompiledFunction`` is a
    class of its own for each compiled graph, so its ``backward`` is wrapped once, on that class.
    """
    nodes = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    seen: set[int] = set()
    for _ in range(_BACKWARD_SEARCH):
        following: list[Any] = []
        for node in nodes:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            cls = getattr(node, "_forward_cls", None)
            if cls is not None and cls.__name__ == "CompiledFunction":
                if not cls.__dict__.get("_autosp_announces", False):
                    cls.backward = staticmethod(_announcing_backward(cls.backward, in_backward))
                    cls._autosp_announces = True
                return True
            following.extend(fn for fn, _ in node.next_functions)
        nodes = following
    return False


def _announcing_backward(
    backward: Callable[..., Any], in_backward: Callable[[], contextlib.AbstractContextManager[Any]]
) -> Callable[..., Any]:
    # Never traced by Dynamo, nor anything it calls: a backward run from a compiled frame (torch.compile
    # of a whole training step, ``loss.backward()`` at its graph break) has Dynamo's frame callback
    # active, which took this wrapper and the compiled backward graph's own code (aot_eager's
    # ``GraphModule.forward``) for user code, and compiled that graph again as a new SP program,
    # its saved shards taken for whole inputs.
    @torch.compiler.disable(recursive=True)
    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        try:
            with in_backward():
                return backward(ctx, *grads)
        except BaseException as e:
            announce(e)
            raise

    return run


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


__all__ = [
    "POLL",
    "WAIT_WARN_S",
    "PeerFailed",
    "PeersLate",
    "announce",
    "announce_backward_of",
    "announcing",
    "counting_error",
    "is_comm_failure",
    "late_message",
    "note_of",
    "peer_note",
    "wait",
]
