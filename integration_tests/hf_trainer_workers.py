"""Workers for test_hf_trainer: a tiny HF Llama fine-tuned by Trainer, plain or with AutoSP.

Module-level functions, since spawned processes import them by name.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

VOCAB, SEQ, ROWS = 96, 32, 16


def dataset() -> list[dict[str, torch.Tensor]]:
    """Counting sequences (learnable within a few steps, so the loss curve moves) with different
    numbers of ignored labels per row, so a token-weighted loss differs from a mean of rows."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(ROWS):
        start, stride = torch.randint(0, VOCAB, (2,), generator=gen).tolist()
        ids = (start + (1 + stride % 3) * torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        labels[: 2 + 3 * (i % 4)] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def model() -> torch.nn.Module:
    from autosp.testing import hf_causal_lm

    torch.manual_seed(0)
    return hf_causal_lm("llama", vocab=VOCAB, dim=32, hidden=64, layers=1, heads=4, kv_heads=2, max_len=SEQ)


def _args(out: str, grad_accum: int, batch: int, steps: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=grad_accum,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, seed=0,
        use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )


def key(grad_accum: int, batch: int) -> str:
    return f"ga{grad_accum}-rows{batch}"


def _accelerate_env(rank: int, world: int) -> None:
    """What torchrun would export; accelerate reads it and reuses the process group the harness made."""
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def train(rank: int, world: int, runs: list[tuple[int, int]], sp_size: int | None, steps: int = 4) -> dict[str, Any]:
    """For each (gradient_accumulation_steps, per-device batch): logged losses, final weights, AutoSP's report.

    ``sp_size=None``: plain ``Trainer`` (no compile); else ``AutoSPTrainer`` with Ulysses on ``aot_eager``,
    checking that the ranks of an SP group got the same tokens (``check_inputs="hash"``).
    """
    from transformers import PrinterCallback, Trainer

    _accelerate_env(rank, world)
    results: dict[str, Any] = {}
    for grad_accum, batch in runs:
        torch._dynamo.reset()  # each run compiles its own shapes; stay under Dynamo's recompile limit
        lm = model()
        with tempfile.TemporaryDirectory() as out:
            args = _args(out, grad_accum, batch, steps)
            if sp_size is None:
                trainer: Any = Trainer(model=lm, args=args, train_dataset=dataset())
            else:
                from autosp_tools.hf import AutoSPTrainer

                trainer = AutoSPTrainer(model=lm, args=args, train_dataset=dataset(), sp_size=sp_size,
                                        autosp_backend="aot_eager", autosp_options={"check_inputs": "hash"})
            trainer.remove_callback(PrinterCallback)  # the test prints the curve itself
            trainer.train()
        report = None
        if sp_size is not None:
            program = trainer._autosp_program
            program = getattr(program, "module", program)  # under DDP
            r = program.autosp_reports[0]
            report = {"sites": len(r.sites), "collectives": dict(r.collectives), "world": world}
        results[key(grad_accum, batch)] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights": {n: p.detach().clone() for n, p in lm.named_parameters()},
            "report": report,
        }
    return results
