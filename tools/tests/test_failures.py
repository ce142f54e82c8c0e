"""The launcher's verdicts, on made-up rank states: cause before consequence, stuck ranks named, watchdog limits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from autosp_tools import faults
from autosp_tools.failures import Record, death, diagnose, is_comm_error, stalled
from autosp_tools.heartbeat import BETWEEN, DONE, IN_STEP, SETUP, RankBeat
from autosp_tools.timeouts import COMPILE_GRACE_S

RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
    "Connection reset by peer."
)
TIMED_OUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv"


def rec(rank: int, t: float, message: str, type_: str = "RuntimeError") -> Record:
    return Record(rank, t, type_, message, f"Traceback ...\n{type_}: {message}", is_comm_error(RuntimeError(message)))


def beat(step: int, phase: float = IN_STEP, since: float = 100.0, longest: float = 1.0, finished: int = 2) -> RankBeat:
    return RankBeat(step, phase, since, longest, finished)


def test_comm_errors_are_told_from_causes() -> None:
    assert is_comm_error(RuntimeError(RESET)) and is_comm_error(RuntimeError(TIMED_OUT))
    assert is_comm_error(dist.DistBackendError("anything"))
    try:
        try:
            raise RuntimeError(RESET)
        except RuntimeError as inner:
            raise ValueError("while syncing") from inner
    except ValueError as outer:
        assert is_comm_error(outer)
    assert not is_comm_error(faults.InjectedFault("boom"))
    assert not is_comm_error(KeyboardInterrupt())


def test_an_exception_outranks_an_earlier_connection_reset() -> None:
    # Rank 0's reset was written first (clocks are close), but it is the consequence.
    records = {0: rec(0, 10.0, RESET), 1: rec(1, 10.1, "CUDA out of memory", "OutOfMemoryError")}
    text = diagnose(records, {0: 1, 1: 1}, [beat(3), beat(3)], 8, 12.0)
    assert text.startswith("rank 1 failed in step 3: OutOfMemoryError: CUDA out of memory\nTraceback")
    assert text.endswith("then, as a consequence:\n  rank 0: RuntimeError: " + RESET)


def test_a_vanished_rank_outranks_the_resets_it_caused() -> None:
    text = diagnose({0: rec(0, 10.0, RESET)}, {0: 1, 1: -9}, [beat(5), beat(5)], 8, 12.0)
    assert text.startswith("rank 1 was killed by SIGKILL (the kernel's out-of-memory killer")
    assert ", in step 5\nthen, as a consequence:\n  rank 0: RuntimeError: " in text


def test_the_silent_rank_is_named_when_its_peers_time_out() -> None:
    text = diagnose(
        {0: rec(0, 20.0, TIMED_OUT), 2: rec(2, 20.2, TIMED_OUT)},
        {0: 1, 1: None, 2: 1},
        [beat(4), beat(4, since=9.0), beat(4)],
        8,
        21.0,
    )
    assert text.startswith(
        "rank 1 stopped responding in step 4: it is alive but has sent no heartbeat for 12 s, "
        "and rank(s) 0, 2 gave up waiting for it in a collective (--timeout 8 s)"
    )


def test_only_comm_errors_blame_the_earliest() -> None:
    text = diagnose({0: rec(0, 5.0, TIMED_OUT), 1: rec(1, 4.0, RESET)}, {0: 1, 1: 1}, [beat(2), beat(2)], 8, 6.0)
    assert text.startswith("rank 1 failed in step 2: RuntimeError: " + RESET)


def test_exit_codes_in_words() -> None:
    assert death(-9).startswith("was killed by SIGKILL")
    assert death(-11) == "was killed by SIGSEGV (a crash in native code)"
    assert death(13).startswith("exited with code 13 without raising a Python exception")
    assert death(0) == "exited (code 0) before finishing"
    # A rank that exits 0 before it said it was done has failed too.
    assert diagnose({}, {0: None, 1: 0}, [beat(2), beat(2, phase=BETWEEN)], 8, 3.0).startswith(
        "rank 1 exited (code 0) before finishing, after step 2"
    )


def test_watchdog_limits() -> None:
    exits = {0: None, 1: None}
    now = 1000.0
    # Within --timeout plus max(10 s, twice the slowest step): nothing to say.
    assert stalled([beat(3, since=now - 17), beat(3, since=now - 1)], exits, 8, now) is None
    # The slowest step so far widens the margin.
    assert stalled([beat(3, since=now - 25, longest=10.0), beat(3, since=now - 1)], exits, 8, now) is None
    verdict = stalled([beat(3, since=now - 19), beat(3, since=now - 30)], exits, 8, now)
    assert verdict is not None
    assert verdict.startswith("no progress: rank 0 in step 3, 19 s after its last heartbeat; rank 1 in step 3, 30 s")
    # Setup and the first step (compiling) get the compile grace; a finished rank is not watched.
    first = [beat(1, since=now - COMPILE_GRACE_S, finished=0), beat(0, SETUP, since=now - COMPILE_GRACE_S, finished=0)]
    assert stalled(first, exits, 8, now) is None
    assert stalled([beat(6, DONE, since=0.0), beat(6, DONE, since=0.0)], {0: 0, 1: 0}, 8, now) is None
    # One that finished training but never exits is stuck too.
    verdict = stalled([beat(6, DONE, since=now - 60)], {0: None}, 8, now)
    assert verdict is not None and verdict.startswith("no progress: rank 0 after training (shutting down)")


@pytest.mark.parametrize("value", ["1:3", "x:3:raise", "1:3:explode", "1:0:raise", "1:3:raise:extra"])
def test_bad_fault_specs_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="AUTOSP_FAULT="):
        faults.parse(value)


def test_fault_fires_only_where_asked() -> None:
    one = faults.parse("1:3:raise")
    assert one.hook(0, 3) is None and one.hook(1, 2) is None
    hook = one.hook(1, 3)
    assert hook is not None
    with pytest.raises(faults.InjectedFault, match="rank 1 in step 3"):
        hook()
    every = faults.parse("*:2:raise")
    assert every.hook(0, 2) is not None and every.hook(5, 2) is not None and every.hook(0, 3) is None


def test_interrupt_fault_reaches_python_where_sigint_is_ignored() -> None:
    # A job started in the background by a script inherits SIGINT ignored (the suite run as `pytest &`):
    # the injected Ctrl-C was lost there and the "interrupted" rank trained on.
    code = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from autosp_tools import faults\n"
        "try:\n"
        "    faults.parse('0:1:interrupt').hook(0, 1)()\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "KeyboardInterrupt", (out.stdout, out.stderr)
