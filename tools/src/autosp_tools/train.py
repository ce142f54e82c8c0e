"""autosp-train: train a small causal LM sequence-parallel with AutoSP.

With no flags it trains a small Llama on the shipped text, sequence length 1024,
on 2 processes that share each sequence (sp_size 2), for 30 steps. It spawns its
own gloo processes, or, under torchrun, uses the process group torchrun set up.

Every rank calls the compiled model with the same full-length batch and gets the
single-device loss; AutoSP already all-reduces the gradients inside the SP group,
so the loop below is an ordinary single-device loop. With several SP groups
(``--dp`` > 1, or ``--nproc`` a multiple of ``--sp-size``) the ranks form a
dp x sp mesh: each SP group trains on different rows of the global batch and
DDP, FSDP2 or DeepSpeed ZeRO averages gradients over the dp group only
(see ``autosp_tools.parallel``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosp_tools import checkpoint, parallel
from autosp_tools.dataset import VOCAB_SIZE, batch_at, load_tokens
from autosp_tools.memory import peak_rss_mb, rss_mb
from autosp_tools.model import PRESETS, ModelConfig, build_model, count_params, resolve_impl

BACKENDS = ("aot_eager", "inductor", "eager", "none")
SAC_CHOICES: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}


class TrainConfigError(ValueError):
    """Flags that cannot work together; the message says what to change."""


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    seq_len: int
    sp_size: int
    nproc: int
    data_parallel: str
    deepspeed: int | None
    variant: str
    sac: bool | str
    backend: str
    steps: int
    batch_size: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    grad_clip: float
    data: str | None
    seed: int
    checkpoint_dir: str | None
    resume: str | None
    save_every: int
    log_every: int
    stop_at: int | None
    show_report: bool
    quiet: bool

    @property
    def dp_size(self) -> int:
        return self.nproc // self.sp_size

    def curve_meta(self, data_bytes: int) -> dict[str, Any]:
        """The settings that decide the loss curve; a resume must match them."""
        return {
            "model": self.model.as_dict(),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "lr": self.lr,
            "min_lr_ratio": self.min_lr_ratio,
            "warmup": self.warmup,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "seed": self.seed,
            "data_bytes": data_bytes,
        }


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autosp-train",
        description="Train a small Llama-style causal LM sequence-parallel with AutoSP (CPU/gloo friendly).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model-size", choices=sorted(PRESETS), default="small")
    m.add_argument("--model-impl", choices=("auto", "hf", "builtin"), default="auto",
                   help="hf: transformers LlamaForCausalLM; builtin: the module in autosp_tools.model")
    for name in ("dim", "layers", "heads", "kv-heads", "hidden"):
        m.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    s = p.add_argument_group("parallelism and compile")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--sp-size", type=int, default=2, help="ranks that share one sequence")
    s.add_argument("--dp", type=int, default=None,
                   help="SP groups that train on different rows of each batch; unset: --nproc / --sp-size")
    s.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default: --dp x --sp-size); ignored under torchrun")
    s.add_argument("--data-parallel", choices=parallel.DATA_PARALLEL, default="ddp",
                   help="how the dp groups share gradients: DDP, or FSDP2 (fully_shard over the dp mesh dim)")
    s.add_argument("--deepspeed", type=int, choices=parallel.DEEPSPEED_STAGES, default=None, metavar="STAGE",
                   help="run through deepspeed.initialize with this ZeRO stage (0, 1 or 2), data-parallel over --dp")
    s.add_argument("--variant", default="ulysses")
    s.add_argument("--sac", choices=tuple(SAC_CHOICES), default="auto",
                   help="activation checkpointing: auto (AutoSP's cost model), true (save most memory), false")
    s.add_argument("--backend", choices=BACKENDS, default="aot_eager",
                   help="compiler after AutoSP; 'none' runs the model eagerly without AutoSP (sp-size 1 only)")
    s.add_argument("--show-report", action="store_true", help="print AutoSP's report after the first step")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step, over all SP groups")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr * this")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 10)")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    t.add_argument("--data", default=None, help="training file, read as bytes (default: the shipped text)")
    t.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("checkpoints and logging")
    c.add_argument("--checkpoint-dir", default=None)
    c.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="checkpoint file or directory; bare --resume: the newest in --checkpoint-dir")
    c.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    c.add_argument("--log-every", type=int, default=1)
    c.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step as if interrupted (checkpoint saved); the schedule still spans --steps")
    c.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")
    return p


def _torchrun_world() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _nearest_multiples(n: int, k: int) -> str:
    lo, hi = (n // k) * k, (n // k + 1) * k
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Check the flags together, before any process starts; raise TrainConfigError."""
    dim, layers, heads, kv_heads, hidden = PRESETS[ns.model_size]
    dim = ns.dim or dim
    layers = ns.layers or layers
    heads = ns.heads or heads
    kv_heads = ns.kv_heads or (kv_heads if heads % kv_heads == 0 else heads)
    hidden = ns.hidden or hidden
    errors: list[str] = []
    if min(dim, layers, heads, kv_heads, hidden) < 1:
        errors.append("--dim, --layers, --heads, --kv-heads and --hidden must be positive")
    elif dim % heads or (dim // heads) % 2:
        errors.append(f"--dim {dim} must be divisible by --heads {heads} with an even head size (RoPE rotates pairs)")
    elif heads % kv_heads:
        errors.append(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} (grouped-query attention)")

    world = _torchrun_world()
    sp = ns.sp_size
    nproc = world if world is not None else (ns.nproc or (ns.dp or 1) * sp)
    if ns.dp is not None and ns.dp < 1:
        errors.append(f"--dp {ns.dp} must be positive")
    elif ns.dp is not None and nproc != ns.dp * sp:
        where = "the torchrun world size" if world is not None else "--nproc"
        errors.append(f"{where} {nproc} is not --dp {ns.dp} x --sp-size {sp}; give one of them, or make them agree")
    if ns.deepspeed == 3:
        errors.append("ZeRO-3 is not supported with AutoSP yet: its per-submodule parameter gathering breaks the "
                      "compiled graph into pieces, and AutoSP needs attention and the sequence in one graph; "
                      "use --deepspeed 1 or 2, or --data-parallel fsdp to shard parameters")
    elif ns.deepspeed is not None and importlib.util.find_spec("deepspeed") is None:
        errors.append("--deepspeed needs the deepspeed package: pip install 'autosp-tools[deepspeed]'")
    if (ns.deepspeed is not None or ns.data_parallel == "fsdp") and (ns.checkpoint_dir or ns.resume):
        what = "--deepspeed" if ns.deepspeed is not None else "--data-parallel fsdp"
        errors.append(f"{what} keeps sharded optimizer state; --checkpoint-dir/--resume support only DDP for now")
    if sp < 1 or nproc < 1:
        errors.append(f"--sp-size ({sp}) and --nproc ({nproc}) must be positive")
    else:
        if ns.seq_len < 2:
            errors.append(f"--seq-len {ns.seq_len} is too short; a causal LM needs at least 2 tokens")
        elif ns.seq_len % sp:
            errors.append(
                f"--seq-len {ns.seq_len} is not divisible by --sp-size {sp}: AutoSP splits each sequence evenly "
                f"over the SP ranks; use --seq-len {_nearest_multiples(ns.seq_len, sp)}"
            )
        if nproc % sp:
            where = "the torchrun world size" if world is not None else "--nproc"
            errors.append(f"{where} {nproc} is not a multiple of --sp-size {sp}; each rank must be in one SP group")
        elif ns.batch_size % (nproc // sp):
            errors.append(
                f"--batch-size {ns.batch_size} must be divisible by the {nproc // sp} SP groups "
                f"(--nproc {nproc} / --sp-size {sp}), which train on different rows"
            )
        if ns.variant == "ulysses" and sp > 1 and heads % sp:
            errors.append(
                f"--heads {heads} is not divisible by --sp-size {sp}: Ulysses gives each rank heads/sp_size heads; "
                "pick an sp-size that divides the head count"
            )
        if ns.backend == "none" and sp > 1:
            errors.append("--backend none runs without AutoSP, so it needs --sp-size 1")
    if ns.batch_size < 1:
        errors.append(f"--batch-size {ns.batch_size} must be positive")
    if ns.steps < 1:
        errors.append(f"--steps {ns.steps} must be positive")
    if ns.stop_at is not None and not 1 <= ns.stop_at <= ns.steps:
        errors.append(f"--stop-at {ns.stop_at} must be between 1 and --steps {ns.steps}")
    if ns.lr <= 0:
        errors.append(f"--lr {ns.lr} must be positive")
    if ns.save_every < 0 or ns.log_every < 1:
        errors.append("--save-every must be >= 0 and --log-every >= 1")
    if (ns.save_every or ns.stop_at) and not ns.checkpoint_dir:
        errors.append("--save-every/--stop-at write checkpoints: give --checkpoint-dir")
    if ns.data is not None and not Path(ns.data).is_file():
        errors.append(f"--data {ns.data}: no such file")
    if sp > 1:
        _check_variant(ns.variant, errors)
    resume = None
    if ns.resume is not None:
        try:
            resume = str(checkpoint.resolve(ns.resume, ns.checkpoint_dir))
        except FileNotFoundError as e:
            errors.append(str(e))
    if errors:
        raise TrainConfigError("\n".join(errors))

    impl = resolve_impl(ns.model_impl)
    warmup = ns.warmup if ns.warmup is not None else max(1, ns.steps // 10)
    return TrainConfig(
        model=ModelConfig(VOCAB_SIZE, dim, layers, heads, kv_heads, hidden, ns.seq_len, impl),
        seq_len=ns.seq_len, sp_size=sp, nproc=nproc, data_parallel=ns.data_parallel, deepspeed=ns.deepspeed,
        variant=ns.variant,
        sac=SAC_CHOICES[ns.sac], backend=ns.backend,
        steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, min_lr_ratio=ns.min_lr_ratio, warmup=warmup,
        weight_decay=ns.weight_decay, grad_clip=ns.grad_clip, data=ns.data, seed=ns.seed,
        checkpoint_dir=ns.checkpoint_dir, resume=resume, save_every=ns.save_every, log_every=ns.log_every,
        stop_at=ns.stop_at, show_report=ns.show_report, quiet=ns.quiet,
    )


def _check_variant(name: str, errors: list[str]) -> None:
    from autosp import ConfigError
    from autosp.registry import get_registry

    try:
        get_registry().variant(name)
    except ConfigError as e:
        errors.append(f"--variant: {e}")


def _check_resume(cfg: TrainConfig) -> None:
    """Refuse a resume whose settings would give another loss curve, before starting ranks."""
    assert cfg.resume is not None
    diff = checkpoint.meta_mismatch(checkpoint.load_meta(cfg.resume), cfg.curve_meta(load_tokens(cfg.data).numel()))
    if diff:
        raise TrainConfigError(f"--resume {cfg.resume}: the run's settings differ from the checkpoint's:\n  "
                               + "\n  ".join(diff))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup then cosine decay; a pure function of the step, so resume needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    ratio = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * ratio


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
    import autosp
    from tqdm import tqdm

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
    if cfg.deepspeed is None:
        parallel.shard_model(cfg.data_parallel, model, groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    meta = cfg.curve_meta(tokens.numel())

    start = 0
    if cfg.resume:
        path = cfg.resume
        state = checkpoint.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = int(state["step"])
        if lead and not cfg.quiet:
            print(f"resumed from {path} at step {start}", flush=True)

    rows = cfg.batch_size // cfg.dp_size
    if cfg.backend == "none":
        program: Any = model
    else:
        program = autosp.compile(model, sp_size=cfg.sp_size, group=groups.sp, variant=cfg.variant, sac=cfg.sac,
                                 backend=cfg.backend)
    trainer: parallel.Trainer
    if cfg.deepspeed is not None:
        # The engine builds its own optimizer from the config; the torch one above stays unused.
        trainer = parallel.deepspeed_trainer(program, groups, parallel.deepspeed_config(
            cfg.deepspeed, rows, cfg.lr, cfg.weight_decay, cfg.grad_clip))
    else:
        trainer = parallel.TorchTrainer(parallel.wrap_data_parallel(cfg.data_parallel, program, groups),
                               list(model.parameters()), optimizer, cfg.grad_clip)

    end = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if lead and not cfg.quiet:
        m = cfg.model
        print(f"autosp-train: {m.impl} Llama dim {m.dim} layers {m.layers} heads {m.heads}/{m.kv_heads} "
              f"({count_params(model):,} params) | seq {cfg.seq_len} x batch {cfg.batch_size} | "
              f"{world} rank(s): sp {cfg.sp_size} x dp {cfg.dp_size} ({_dp_name(cfg)}) | {cfg.variant}, "
              f"backend {cfg.backend}, sac {cfg.sac} | steps {start + 1}..{end} of {cfg.steps}", flush=True)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses: list[float] = []
    times: list[float] = []
    saved: str | None = None
    bar = tqdm(total=cfg.steps, initial=start, disable=not lead or cfg.quiet, unit="step", dynamic_ncols=True)
    for step in range(start, end):
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        full = batch_at(tokens, step, cfg.seed, cfg.batch_size, cfg.seq_len)
        ids = full[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
        losses.append(float(parallel.mean_over_dp(trainer.step(ids, lr), groups)))
        times.append(time.perf_counter() - t0)
        n = step + 1

        if step == start and cfg.show_report and lead and cfg.backend != "none":
            print("\n\n".join(str(r) for r in getattr(program, "autosp_reports", [])), flush=True)
        if n % cfg.log_every == 0 or n == end:
            mem = _gather_floats(rss_mb(), world)  # every rank joins, only rank 0 prints
            if lead and not cfg.quiet:
                tps = tokens_per_step / times[-1]
                bar.set_postfix_str(f"loss {losses[-1]:.4f} | {tps:,.0f} tok/s | RSS "
                                    + " ".join(f"r{r}:{m:.0f}MB" for r, m in enumerate(mem)))
                bar.write(f"step {n:5d}/{cfg.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s")
        bar.update(1)
        if cfg.checkpoint_dir and ((cfg.save_every and n % cfg.save_every == 0) or n == end):
            if lead:
                saved = str(checkpoint.save(cfg.checkpoint_dir, {
                    "step": n, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": torch.get_rng_state(), "meta": meta, "losses": losses,
                }))
            if world > 1:
                dist.barrier()  # a resume that starts right after must find the file
    bar.close()

    steady = times[1:]
    steady_tps = tokens_per_step * len(steady) / sum(steady) if steady else 0.0
    compile_s = max(0.0, times[0] - sorted(steady)[len(steady) // 2]) if steady else 0.0
    return TrainResult(
        losses=losses, start_step=start, end_step=end, tokens_per_step=tokens_per_step,
        first_step_s=times[0] if times else 0.0, steady_tokens_per_s=steady_tps, compile_s=compile_s,
        wall_s=time.perf_counter() - t_start, peak_rss_mb=_gather_floats(peak_rss_mb(), world),
        checkpoint=saved, params=count_params(model),
    )


def run(argv: Sequence[str] | None = None) -> TrainResult:
    """Parse ``argv`` (default: no flags), launch the ranks, train; return rank 0's result.

    Raises ``TrainConfigError`` for flags that cannot work, before starting any process.
    With ``--nproc`` > 1 the ranks are spawned, so a script that calls this needs the
    usual ``if __name__ == "__main__":`` guard.
    """
    ns = build_parser().parse_args(list(argv) if argv is not None else [])
    cfg = config_from_args(ns)
    if cfg.resume:
        _check_resume(cfg)
    from autosp_tools.launch import launch

    result = launch(train, cfg)
    # Under torchrun every rank returns here; only rank 0 speaks.
    if not cfg.quiet and int(os.environ.get("RANK", "0")) == 0:
        print(result.summary(), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except TrainConfigError as e:
        parser.error(str(e))


__all__ = ["TrainConfig", "TrainConfigError", "TrainResult", "build_parser", "config_from_args", "lr_at", "main",
           "run", "train"]


if __name__ == "__main__":
    main()
