"""What a failed rank reports, and which rank's failure caused a job's end.

When one rank fails the others fail too, a moment later, with communication errors
("Connection reset by peer", or a collective that timed out waiting). The launcher
reports the cause, not the lowest rank's consequence: an exception that is not a
communication error comes first (the earliest), then a rank that vanished without a
word (killed by a signal, or ``os._exit``), then a rank that is alive but stopped
responding while its peers timed out waiting for it, and only then the earliest
communication error.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from autosp_tools.heartbeat import DONE, IN_STEP, RankBeat
from autosp_tools.timeouts import COMPILE_GRACE_S, SLACK_S

# gloo raises plain RuntimeErrors; these phrases mark the ones about peers and timeouts.
_COMM_MARKERS = ("/gloo/", "Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting")


def is_comm_error(e: BaseException) -> bool:
    """An error that says a peer went away or a collective timed out, rather than what went wrong."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistError) or any(m in str(err) for m in _COMM_MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


@dataclass(frozen=True)
class Record:
    """One rank's exception, as written by the rank before it exits."""

    rank: int
    time: float  # time.monotonic(), comparable across processes on Linux and macOS
    type: str
    message: str
    traceback: str
    comm: bool

    def line(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first}" if first else self.type


def write_record(out_dir: str | Path, rank: int, e: BaseException) -> None:
    rec = {
        "rank": rank,
        "time": time.monotonic(),
        "type": type(e).__name__,
        "message": str(e),
        "traceback": traceback.format_exc(),
        "comm": is_comm_error(e),
    }
    path = Path(out_dir, f"error{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)  # the launcher never reads half a record


def read_records(out_dir: str | Path) -> dict[int, Record]:
    out: dict[int, Record] = {}
    for p in Path(out_dir).glob("error*.json"):
        rec = Record(**json.loads(p.read_text()))
        out[rec.rank] = rec
    return out


def death(code: int) -> str:
    """How a process ended, in words, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": " (the kernel's out-of-memory killer sends SIGKILL: check memory)",
            "SIGSEGV": " (a crash in native code)",
            "SIGABRT": " (an abort in native code)",
        }.get(name, "")
        return f"was killed by {name}{hint}"
    if code == 0:
        return "exited (code 0) before finishing"
    return f"exited with code {code} without raising a Python exception (os._exit, or a crash in native code)"


def gone(code: int | None, beat: RankBeat) -> bool:
    """A process that ended in failure: non-zero, or zero before it said it was done."""
    return code is not None and (code != 0 or beat.phase != DONE)


def limit_s(beat: RankBeat, timeout_s: float) -> float:
    """How long a rank may go without a heartbeat before the watchdog calls it stuck."""
    if beat.finished == 0:
        return timeout_s + COMPILE_GRACE_S
    return timeout_s + max(SLACK_S, 2 * beat.longest_step_s)


def _for(beats: list[RankBeat], r: int, now: float) -> str:
    b = beats[r]
    return f"{b.doing()}, {now - b.since:.0f} s after its last heartbeat" if b.phase == IN_STEP else b.doing()


def stalled(beats: list[RankBeat], exits: dict[int, int | None], timeout_s: float, now: float) -> str | None:
    """The watchdog's verdict when no rank has failed: None, or why the job must end."""
    watched = [r for r in range(len(beats)) if exits[r] is None]
    if not any(now - beats[r].since > limit_s(beats[r], timeout_s) for r in watched):
        return None
    # Name every rank still working, not only the first over its limit: they are usually stuck together.
    parts = "; ".join(f"rank {r} {_for(beats, r, now)}" for r in watched)
    return (
        f"no progress: {parts}. Each step must end within --timeout {timeout_s:g} s plus "
        f"max({SLACK_S:g} s, twice the slowest step) (the first, which compiles, {COMPILE_GRACE_S:g} s more); "
        "ending the job. If steps are legitimately this slow, raise --timeout."
    )


def diagnose(
    records: dict[int, Record], exits: dict[int, int | None], beats: list[RankBeat], timeout_s: float, now: float
) -> str:
    """The job's first failure, then one line per other rank that failed as a consequence."""
    causes = sorted((r for r in records.values() if not r.comm), key=lambda r: r.time)
    dead = [r for r, code in exits.items() if r not in records and code is not None and gone(code, beats[r])]
    comm = sorted((r for r in records.values() if r.comm), key=lambda r: r.time)
    blamed: int
    if causes:
        c = causes[0]
        blamed = c.rank
        head = f"rank {c.rank} failed {beats[c.rank].doing()}: {c.line()}\n{c.traceback.rstrip()}"
    elif dead:
        blamed = dead[0]
        code = exits[blamed]
        assert code is not None
        head = f"rank {blamed} {death(code)}, {beats[blamed].doing()}"
    else:
        hung = [r for r, code in exits.items() if code is None and r not in records]
        if comm and hung:
            blamed = hung[0]
            waiting = ", ".join(str(r.rank) for r in comm)
            head = (
                f"rank {blamed} stopped responding {beats[blamed].doing()}: it is alive but has sent no "
                f"heartbeat for {now - beats[blamed].since:.0f} s, and rank(s) {waiting} gave up waiting for "
                f"it in a collective (--timeout {timeout_s:g} s)"
            )
            if len(hung) > 1:
                head += f"; also unresponsive: rank(s) {', '.join(map(str, hung[1:]))}"
        elif comm:
            c = comm[0]
            blamed = c.rank
            head = f"rank {c.rank} failed {beats[c.rank].doing()}: {c.line()}\n{c.traceback.rstrip()}"
        else:
            return "the ranks ended without reporting a failure"
    others = [
        f"  rank {r.rank}: {r.line()}" for r in sorted(records.values(), key=lambda r: r.time) if r.rank != blamed
    ]
    others += [
        f"  rank {r} {death(code)}"
        for r, code in exits.items()
        if r != blamed and r not in records and code is not None and gone(code, beats[r])
    ]
    if others:
        head += "\nthen, as a consequence:\n" + "\n".join(others)
    return head


def conclusive(records: dict[int, Record], exits: dict[int, int | None], beats: list[RankBeat]) -> bool:
    """Whether the cause is already known: an exception that is not a communication error, or a vanished rank."""
    return any(not r.comm for r in records.values()) or any(
        r not in records and gone(code, beats[r]) for r, code in exits.items()
    )


__all__ = [
    "Record",
    "conclusive",
    "death",
    "diagnose",
    "gone",
    "is_comm_error",
    "limit_s",
    "read_records",
    "stalled",
    "write_record",
]
