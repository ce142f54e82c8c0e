"""The training loop of autosp-train on one rank: build, compile, wrap for data parallelism, step.

Every rank calls the compiled model with the same full-length batch and gets the
single-device loss; AutoSP already all-reduces the gradients inside the SP group,
so the loop is an ordinary single-device loop. With several SP groups the ranks form
a dp x sp mesh: each SP group trains on different rows of the global batch and DDP,
FSDP2 or DeepSpeed ZeRO averages gradients over the dp group only
(see ``autosp_tools.parallel``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autosp_tools import checkpoint, faults, heartbeat, parallel, timeouts
from autosp_tools.config import TrainConfig
from autosp_tools.dataset import batch_at, load_tokens
from autosp_tools.memory import peak_rss_mb, rss_mb
from autosp_tools.model import build_model, count_params
from autosp_tools.schedule import lr_at


@dataclass
class TrainResult:
    """What one invocation did; ``losses[k]`` is the loss of step ``start_step + k + 1``."""

    losses: list[float]
    start_step: int
    end_step: int
    tokens_per_step: int
    first_step_s: float = 0.0
    steady_tokens_per_s: float = 0.0
    compile_s: float = 0.0
    wall_s: float = 0.0
    peak_rss_mb: list[float] = field(default_factory=list)
    checkpoint: str | None = None
    params: int = 0

    def summary(self) -> str:
        final = f"{self.losses[-1]:.4f}" if self.losses else "n/a"
        mem = ", ".join(f"rank {r}: {m:.0f} MB" for r, m in enumerate(self.peak_rss_mb))
        lines = [
            f"steps {self.start_step + 1}..{self.end_step} ({len(self.losses)} run), final loss {final}",
            f"params {self.params:,}, tokens/step {self.tokens_per_step:,}",
            f"throughput {self.steady_tokens_per_s:,.0f} tokens/s (steps after the first)",
            f"first step {self.first_step_s:.1f} s, of which compile ~{self.compile_s:.1f} s; wall {self.wall_s:.1f} s",
            f"peak RSS {mem}",
        ]
        if self.checkpoint:
            lines.append(f"checkpoint {self.checkpoint}")
        return "\n".join(lines)


def _gather_floats(value: float, world: int) -> list[float]:
    if world == 1:
        return [value]
    t = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [float(x) for x in out]


def _dp_name(cfg: TrainConfig) -> str:
    return f"deepspeed zero-{cfg.deepspeed}" if cfg.deepspeed is not None else cfg.data_parallel


def train(cfg: TrainConfig, rank: int = 0, world: int = 1) -> TrainResult:
    """The training loop on one rank; the process group (if world > 1) is already up."""
    from tqdm import tqdm

    import autosp

    t_start = time.perf_counter()
    lead = rank == 0
    tokens = load_tokens(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    if world > 1:
        # Identical weights on every rank are the contract; broadcasting guards against any init nondeterminism.
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    groups = parallel.make_groups(cfg.dp_size, cfg.sp_size, world)
    timeouts.apply(timeouts.first_step(cfg))  # the mesh's subgroups would otherwise wait 30 minutes
    if cfg.deepspeed is None:
        parallel.shard_model(cfg.data_parallel, model, groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    meta = cfg.curve_meta()
    fault = faults.from_env()

    start = 0
    history: list[float] = []  # the losses of the steps before this run, carried from checkpoint to checkpoint
    if cfg.resume:
        path = cfg.resume
        state = checkpoint.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = int(state["step"])
        history = list(state.get("losses", []))
        if lead and not cfg.quiet:
            print(f"resumed from {path} at step {start}", flush=True)

    rows = cfg.batch_size // cfg.dp_size
    if cfg.backend == "none":
        program: Any = model
    else:
        program = autosp.compile(
            model, sp_size=cfg.sp_size, group=groups.sp, variant=cfg.variant, sac=cfg.sac, backend=cfg.backend
        )
    trainer: parallel.Trainer
    if cfg.deepspeed is not None:
        # The engine builds its own optimizer from the config; the torch one above stays unused.
        trainer = parallel.deepspeed_trainer(
            program, groups, parallel.deepspeed_config(cfg.deepspeed, rows, cfg.lr, cfg.weight_decay, cfg.grad_clip)
        )
    else:
        trainer = parallel.TorchTrainer(
            parallel.wrap_data_parallel(cfg.data_parallel, program, groups),
            list(model.parameters()),
            optimizer,
            cfg.grad_clip,
        )

    end = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if lead and not cfg.quiet:
        m = cfg.model
        print(
            f"autosp-train: {m.impl} Llama dim {m.dim} layers {m.layers} heads {m.heads}/{m.kv_heads} "
            f"({count_params(model):,} params) | seq {cfg.seq_len} x batch {cfg.batch_size} | "
            f"{world} rank(s): sp {cfg.sp_size} x dp {cfg.dp_size} ({_dp_name(cfg)}) | {cfg.variant}, "
            f"backend {cfg.backend}, sac {cfg.sac} | steps {start + 1}..{end} of {cfg.steps}",
            flush=True,
        )
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses: list[float] = []
    times: list[float] = []
    saved: str | None = None
    if world > 1:
        # tqdm's default lock is a multiprocessing semaphore; a rank that dies holding one
        # makes Python warn of a leak at exit. Bars never cross processes here.
        tqdm.set_lock(threading.RLock())
    bar = tqdm(total=cfg.steps, initial=start, disable=not lead or cfg.quiet, unit="step", dynamic_ncols=True)
    for step in range(start, end):
        n = step + 1
        heartbeat.step_started(n)
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        full = batch_at(tokens, step, cfg.seed, cfg.batch_size, cfg.seq_len)
        ids = full[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
        hook = fault.hook(rank, n) if fault is not None else None
        losses.append(float(parallel.mean_over_dp(trainer.step(ids, lr, hook), groups)))
        times.append(time.perf_counter() - t0)
        heartbeat.step_finished(n)
        if step == start:
            # Compiled; from now on --timeout holds, also on groups AutoSP made while compiling.
            timeouts.apply(timeouts.steady(cfg))

        if step == start and cfg.show_report and lead and cfg.backend != "none":
            print("\n\n".join(str(r) for r in getattr(program, "autosp_reports", [])), flush=True)
        if n % cfg.log_every == 0 or n == end:
            mem = _gather_floats(rss_mb(), world)  # every rank joins, only rank 0 prints
            if lead and not cfg.quiet:
                tps = tokens_per_step / times[-1]
                bar.set_postfix_str(
                    f"loss {losses[-1]:.4f} | {tps:,.0f} tok/s | RSS "
                    + " ".join(f"r{r}:{m:.0f}MB" for r, m in enumerate(mem))
                )
                bar.write(f"step {n:5d}/{cfg.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s")
        bar.update(1)
        if cfg.checkpoint_dir and ((cfg.save_every and n % cfg.save_every == 0) or n == end):
            if lead:
                saved = str(
                    checkpoint.save(
                        cfg.checkpoint_dir,
                        {
                            "step": n,
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "rng": torch.get_rng_state(),
                            "meta": meta,
                            "losses": history + losses,
                        },
                    )
                )
            if world > 1:
                dist.barrier()  # a resume that starts right after must find the file
    bar.close()

    steady = times[1:]
    steady_tps = tokens_per_step * len(steady) / sum(steady) if steady else 0.0
    compile_s = max(0.0, times[0] - sorted(steady)[len(steady) // 2]) if steady else 0.0
    return TrainResult(
        losses=losses,
        start_step=start,
        end_step=end,
        tokens_per_step=tokens_per_step,
        first_step_s=times[0] if times else 0.0,
        steady_tokens_per_s=steady_tps,
        compile_s=compile_s,
        wall_s=time.perf_counter() - t_start,
        peak_rss_mb=_gather_floats(peak_rss_mb(), world),
        checkpoint=saved,
        params=count_params(model),
    )


__all__ = ["TrainResult", "train"]
