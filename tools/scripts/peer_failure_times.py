"""How long the other ranks wait when one rank's SP program raises: a token id outside the
embedding's range (or a label outside the vocabulary) in one rank's part of the sequence.

    python tools/scripts/peer_failure_times.py [--timeout 120]

Each case runs a 1-layer Llama-style model on fresh gloo CPU ranks: one good step (compiles), then
the bad one. Prints, per rank, the error of the bad step and the seconds from its start: the
failed rank's own error, and ``PeerFailed`` on the others (``autosp.peer_failure``), or
``CollectiveFailure`` at the group's timeout (``--timeout``) where no note reaches them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

CASES = (  # world, variant, backend, what is out of range
    (2, "ulysses", "aot_eager", "ids"),
    (2, "ulysses", "inductor", "ids"),
    (2, "ring", "aot_eager", "labels"),
    (3, "ring", "inductor", "ids"),
    (4, "hybrid", "aot_eager", "ids"),
)
SEQ, VOCAB = 48, 96


@dataclass
class _Cfg:
    variant: str
    backend: str
    what: str
    nproc: int
    timeout: float  # seconds: the groups' timeout after the compiling step, as autosp-train sets it


def _rank(cfg: _Cfg, rank: int, world: int) -> list[str]:
    import autosp
    from autosp.testing.models import Config, LlamaLike
    from autosp_tools import timeouts

    torch.manual_seed(0)
    model = autosp.compile(LlamaLike(Config(layers=1, vocab=VOCAB)), backend=cfg.backend, variant=cfg.variant)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model(ids, ids)
    timeouts.apply(timeouts.steady(cfg))
    bad_ids, bad_labels = ids.clone(), ids.clone()
    (bad_ids if cfg.what == "ids" else bad_labels)[1, (world - 1) * (SEQ // world) + 3] = VOCAB + 5
    start = time.perf_counter()
    try:
        model(bad_ids, bad_labels)
        line = "no error"
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        line = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:110]}"
    # Through the store (the group is broken now). Every rank stays alive until all have failed: a
    # failed rank that exits would close its connections, and its peers would fail on that instead.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"peer_failure_times/{rank}", f"rank {rank}: {time.perf_counter() - start:6.2f} s  {line}")
    store.wait([f"peer_failure_times/{r}" for r in range(world)])
    return [store.get(f"peer_failure_times/{r}").decode() for r in range(world)]


def main() -> int:
    from autosp_tools.launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=120.0, help="the process group's timeout, seconds")
    args = ap.parse_args()
    for world, variant, backend, what in CASES:
        position = (world - 1) * (SEQ // world) + 3
        print(f"P={world} {variant} {backend}, {what} out of range at position {position} of {SEQ}:")
        for line in launch(_rank, _Cfg(variant, backend, what, world, args.timeout)):
            print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
