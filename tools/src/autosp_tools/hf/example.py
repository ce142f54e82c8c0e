"""Fine-tune a tiny Llama with ``AutoSPTrainer`` and print its loss curve beside a 1-process ``Trainer``.

    python -m autosp_tools.hf.example            # sp=2 on 2 spawned gloo processes, 4 steps
    python -m autosp_tools.hf.example --nproc 4 --sp-size 2 --grad-accum 2

The 1-process reference is a plain ``transformers.Trainer`` on the same global batch
(``batch * nproc / sp_size`` rows a step). The integration test (``test_hf_trainer``)
checks these same runs step by step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosp.options import Backend

VOCAB, SEQ, ROWS = 96, 32, 16


@dataclass(frozen=True)
class Run:
    """One fine-tuning run; ``sp_size=None`` is the plain-Trainer reference."""

    nproc: int = 2
    sp_size: int | None = 2
    steps: int = 4
    grad_accum: int = 1
    batch: int = 2  # per SP group and micro-step
    backend: Backend = "aot_eager"
    timeout: float = 600.0


def dataset() -> list[dict[str, torch.Tensor]]:
    """Counting sequences (learnable in a few steps, so the curve moves) with different numbers of
    ignored labels per row, so a token-weighted loss differs from a mean of per-row losses."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(ROWS):
        start, stride = torch.randint(0, VOCAB, (2,), generator=gen).tolist()
        ids = (start + (1 + stride % 3) * torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        labels[: 2 + 3 * (i % 4)] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def tiny_llama() -> torch.nn.Module:
    from autosp.testing import hf_causal_lm

    torch.manual_seed(0)
    return hf_causal_lm("llama", vocab=VOCAB, dim=32, hidden=64, layers=1, heads=4, kv_heads=2, max_len=SEQ)


def _accelerate_env(rank: int, world: int) -> None:
    """What torchrun would export; accelerate reads it and keeps the process group already made."""
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def train(run: Run, rank: int, world: int, **trainer_kwargs: Any) -> Any:
    """Train ``tiny_llama`` on this rank (process group already up when ``world > 1``); returns the Trainer."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    _accelerate_env(rank, world)
    torch._dynamo.reset()  # each run compiles its own shapes; stay under Dynamo's recompile limit
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=run.steps,
            per_device_train_batch_size=run.batch,
            gradient_accumulation_steps=run.grad_accum,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            logging_steps=1,
            seed=0,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer: Any
        if run.sp_size is None:
            trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset())
        else:
            from autosp_tools.hf import AutoSPTrainer

            trainer = AutoSPTrainer(
                model=tiny_llama(),
                args=args,
                train_dataset=dataset(),
                sp_size=run.sp_size,
                autosp_backend=run.backend,
                **trainer_kwargs,
            )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return trainer


def losses(trainer: Any) -> list[float]:
    """The loss Trainer logged at each step (``logging_steps=1``)."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _curve(run: Run, rank: int, world: int) -> list[float]:
    return losses(train(run, rank, world))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m autosp_tools.hf.example", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="rows per SP group and micro-step")
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    a = p.parse_args(argv)
    if a.nproc % a.sp_size:
        p.error(f"--sp-size {a.sp_size} must divide --nproc {a.nproc}")
    from autosp_tools.launch import launch

    dp = a.nproc // a.sp_size
    backend: Backend = a.backend
    sp = Run(nproc=a.nproc, sp_size=a.sp_size, steps=a.steps, grad_accum=a.grad_accum, batch=a.batch, backend=backend)
    ref = Run(nproc=1, sp_size=None, steps=a.steps, grad_accum=a.grad_accum, batch=a.batch * dp)
    want = launch(_curve, ref, always_spawn=True)
    got = launch(_curve, sp)
    print(f"step | 1 process (Trainer) | {a.nproc} processes, sp={a.sp_size} (AutoSPTrainer) | relative difference")
    for step, (w, g) in enumerate(zip(want, got), 1):
        print(f"{step:4d} | {w:.6f} | {g:.6f} | {abs(g - w) / abs(w):.1e}")


if __name__ == "__main__":
    main()
