"""Workers for test_hf_trainer: ``autosp_tools.hf.example``'s tiny Llama, plain Trainer or AutoSPTrainer.

Module-level functions, since spawned processes import them by name.
"""

from __future__ import annotations

from typing import Any

from autosp_tools.hf.example import Run, losses, train


def key(grad_accum: int, batch: int) -> str:
    return f"ga{grad_accum}-rows{batch}"


def fine_tune(rank: int, world: int, runs: list[tuple[int, int]], sp_size: int | None) -> dict[str, Any]:
    """For each (gradient_accumulation_steps, per-device batch): logged losses, final weights, AutoSP's report.

    ``sp_size=None``: plain ``Trainer``; else ``AutoSPTrainer`` (Ulysses, ``aot_eager``) checking that the
    ranks of an SP group got the same tokens (``check_inputs="hash"``).
    """
    results: dict[str, Any] = {}
    for grad_accum, batch in runs:
        run = Run(nproc=world, sp_size=sp_size, grad_accum=grad_accum, batch=batch)
        extra = {} if sp_size is None else {"autosp_options": {"check_inputs": "hash"}}
        trainer = train(run, rank, world, **extra)
        report = None
        if sp_size is not None:
            program = trainer._autosp_program
            program = getattr(program, "module", program)  # under DDP
            r = program.autosp_reports[0]
            report = {"sites": len(r.sites), "collectives": dict(r.collectives), "world": world}
        results[key(grad_accum, batch)] = {
            "losses": losses(trainer),
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "report": report,
        }
    return results
