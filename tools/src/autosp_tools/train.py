"""autosp-train: train a small causal LM sequence-parallel with AutoSP (the command line).

With no flags it trains a small Llama on the shipped text, sequence length 1024,
on 2 processes that share each sequence (sp_size 2), for 30 steps. It spawns its
own gloo processes, or, under torchrun, uses the process group torchrun set up.

One module a concern: flags and their checks (``config``), the loop on one rank
(``loop``), the learning-rate schedule (``schedule``), checks before a resume
(``resume``), checkpoints with checksums (``checkpoint``), starting and watching
the ranks (``launch``, ``failures``, ``heartbeat``, ``timeouts``). A rank that fails
or stops responding ends the job within ``--timeout`` with a message naming it and its step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from autosp_tools.config import (
    BACKENDS,
    SAC_CHOICES,
    TrainConfig,
    TrainConfigError,
    build_parser,
    config_from_args,
    torchrun_world,
)
from autosp_tools.loop import TrainResult, train
from autosp_tools.resume import check_resume, prepare_checkpoint_dir
from autosp_tools.schedule import lr_at


def run(argv: Sequence[str] | None = None) -> TrainResult:
    """Parse ``argv`` (default: no flags), launch the ranks, train; return rank 0's result.

    Raises ``TrainConfigError`` for flags that cannot work, before starting any process,
    and ``launch.RankFailed`` naming the rank and step when a spawned rank fails or stops
    responding. With ``--nproc`` > 1 the ranks are spawned, so a script that calls this
    needs the usual ``if __name__ == "__main__":`` guard.
    """
    ns = build_parser().parse_args(list(argv) if argv is not None else [])
    cfg = config_from_args(ns)
    if cfg.resume:
        check_resume(cfg)
    lead = int(os.environ.get("RANK", "0")) == 0
    if lead:
        for note in cfg.resume_notes:
            print(note, file=sys.stderr, flush=True)
    prepare_checkpoint_dir(cfg)
    from autosp_tools.launch import launch

    result = launch(train, cfg)
    # Under torchrun every rank returns here; only rank 0 speaks.
    if not cfg.quiet and lead:
        print(result.summary(), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    from autosp_tools.launch import RankFailed

    parser = build_parser()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except TrainConfigError as e:
        parser.error(str(e))
    except RankFailed as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted\n")


__all__ = [
    "BACKENDS",
    "SAC_CHOICES",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "build_parser",
    "config_from_args",
    "lr_at",
    "main",
    "torchrun_world",
    "run",
    "train",
]


if __name__ == "__main__":
    main()
