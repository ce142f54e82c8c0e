"""autosp-train's flags: the parser, and every value checked, alone and together, before any process starts.

Nothing is replaced silently: a flag given is used or refused with a message that
says what to give instead; only flags left out take the preset's or default value.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autosp_tools import checkpoint, faults, parallel
from autosp_tools.dataset import VOCAB_SIZE, default_data_path
from autosp_tools.model import PRESETS, ModelConfig, resolve_impl

BACKENDS = ("aot_eager", "inductor", "eager", "none")
SAC_CHOICES: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}
DEFAULT_TIMEOUT_S = 300.0


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
    timeout: float = DEFAULT_TIMEOUT_S
    data_sha256: str = ""
    resume_notes: tuple[str, ...] = ()

    @property
    def dp_size(self) -> int:
        return self.nproc // self.sp_size

    def curve_meta(self) -> dict[str, Any]:
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
            "data_sha256": self.data_sha256,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autosp-train",
        description="Train a small Llama-style causal LM sequence-parallel with AutoSP (CPU/gloo friendly).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model-size", choices=sorted(PRESETS), default="small")
    m.add_argument(
        "--model-impl",
        choices=("auto", "hf", "builtin"),
        default="auto",
        help="hf: transformers LlamaForCausalLM; builtin: the module in autosp_tools.model",
    )
    for name in ("dim", "layers", "heads", "kv-heads", "hidden"):
        m.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    s = p.add_argument_group("parallelism and compile")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--sp-size", type=int, default=2, help="ranks that share one sequence")
    s.add_argument(
        "--dp",
        type=int,
        default=None,
        help="SP groups that train on different rows of each batch; unset: --nproc / --sp-size",
    )
    s.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to spawn (default: --dp x --sp-size); under torchrun it must equal the world size",
    )
    s.add_argument(
        "--data-parallel",
        choices=parallel.DATA_PARALLEL,
        default="ddp",
        help="how the dp groups share gradients: DDP, or FSDP2 (fully_shard over the dp mesh dim)",
    )
    s.add_argument(
        "--deepspeed",
        type=int,
        choices=parallel.DEEPSPEED_STAGES,
        default=None,
        metavar="STAGE",
        help="run through deepspeed.initialize with this ZeRO stage (0, 1 or 2), data-parallel over --dp",
    )
    s.add_argument("--variant", default="ulysses")
    s.add_argument(
        "--sac",
        choices=tuple(SAC_CHOICES),
        default="auto",
        help="activation checkpointing: auto (AutoSP's cost model), true (save most memory), false",
    )
    s.add_argument(
        "--backend",
        choices=BACKENDS,
        default="aot_eager",
        help="compiler after AutoSP; 'none' runs the model eagerly without AutoSP (sp-size 1 only)",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a collective that waits longer than this for a peer fails (spawned or under torchrun); "
        "spawned ranks that make no progress for this long (plus a margin; the first step, which "
        "compiles, 10 minutes more) end the job, naming the rank and the step",
    )
    s.add_argument("--show-report", action="store_true", help="print AutoSP's report after the first step")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step, over all SP groups")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr * this (0 to 1)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps, 0 to --steps (default: steps // 10)")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this; 0 disables clipping")
    t.add_argument("--data", default=None, help="training file, read as bytes (default: the shipped text)")
    t.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("checkpoints and logging")
    c.add_argument("--checkpoint-dir", default=None, help="directory for checkpoints (created if missing)")
    c.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="a checkpoint file or directory; bare --resume: the newest in --checkpoint-dir, refused if "
        "its checksum fails; 'auto': the newest good one there, skipping bad ones (a fresh start "
        "if there is none yet)",
    )
    c.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    c.add_argument("--log-every", type=int, default=1)
    c.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop after this step as if interrupted (checkpoint saved); the schedule still spans --steps",
    )
    c.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")
    return p


def torchrun_world() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _model_dims(ns: argparse.Namespace, errors: list[str]) -> tuple[int, int, int, int, int]:
    preset = dict(zip(("dim", "layers", "heads", "kv_heads", "hidden"), PRESETS[ns.model_size]))
    given = {k: getattr(ns, k) for k in preset if getattr(ns, k) is not None}
    for k, v in given.items():
        if v < 1:
            errors.append(
                f"--{k.replace('_', '-')} {v} must be a positive integer "
                f"(leave it out for the {ns.model_size} preset's {preset[k]})"
            )
    dims = {**preset, **{k: v for k, v in given.items() if v >= 1}}
    if "kv_heads" not in given and dims["heads"] % dims["kv_heads"]:
        # The preset's kv heads only fit its own head count; with other --heads, every head has its own k/v.
        dims["kv_heads"] = dims["heads"]
    dim, heads, kv_heads = dims["dim"], dims["heads"], dims["kv_heads"]
    if dim % heads or (dim // heads) % 2:
        errors.append(f"--dim {dim} must be divisible by --heads {heads} with an even head size (RoPE rotates pairs)")
    elif heads % kv_heads:
        errors.append(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} (grouped-query attention)")
    return dim, dims["layers"], heads, kv_heads, dims["hidden"]


def _check_numbers(ns: argparse.Namespace, errors: list[str]) -> None:
    for flag, value in (
        ("--lr", ns.lr),
        ("--min-lr-ratio", ns.min_lr_ratio),
        ("--weight-decay", ns.weight_decay),
        ("--grad-clip", ns.grad_clip),
        ("--timeout", ns.timeout),
    ):
        if not math.isfinite(value):
            errors.append(f"{flag} {value} must be a finite number")
    if ns.lr <= 0:
        errors.append(f"--lr {ns.lr} must be positive")
    if not 0 <= ns.min_lr_ratio <= 1:
        errors.append(
            f"--min-lr-ratio {ns.min_lr_ratio} must be between 0 and 1: the cosine decay ends at "
            "--lr x this (a negative ratio would train with a negative learning rate)"
        )
    if ns.weight_decay < 0:
        errors.append(f"--weight-decay {ns.weight_decay} must be >= 0")
    if ns.grad_clip < 0:
        errors.append(f"--grad-clip {ns.grad_clip} must be >= 0 (0 disables clipping)")
    if ns.timeout <= 0:
        errors.append(f"--timeout {ns.timeout} must be a positive number of seconds")
    if ns.batch_size < 1:
        errors.append(f"--batch-size {ns.batch_size} must be positive")
    if ns.steps < 1:
        errors.append(f"--steps {ns.steps} must be positive")
    elif ns.warmup is not None and not 0 <= ns.warmup <= ns.steps:
        errors.append(f"--warmup {ns.warmup} must be between 0 and --steps {ns.steps}")
    if ns.stop_at is not None and not 1 <= ns.stop_at <= ns.steps:
        errors.append(f"--stop-at {ns.stop_at} must be between 1 and --steps {ns.steps}")
    if not 0 <= ns.seed < 2**63:
        errors.append(f"--seed {ns.seed} must be between 0 and 2**63 - 1")
    if ns.save_every < 0:
        errors.append(f"--save-every {ns.save_every} must be >= 0 (0: only at the end)")
    if ns.log_every < 1:
        errors.append(f"--log-every {ns.log_every} must be >= 1")


def _check_parallel(ns: argparse.Namespace, heads: int, errors: list[str]) -> int:
    """Check the process layout; return the number of ranks."""
    world = torchrun_world()
    sp = ns.sp_size
    where = "the torchrun world size" if world is not None else "--nproc"
    if ns.nproc is not None and ns.nproc < 1:
        errors.append(f"--nproc {ns.nproc} must be positive (leave it out for --dp x --sp-size)")
    if ns.nproc is not None and world is not None and ns.nproc != world:
        errors.append(
            f"--nproc {ns.nproc} differs from the torchrun world size {world}: under torchrun leave "
            "--nproc out, or make it agree"
        )
    if sp < 1:
        errors.append(f"--sp-size {sp} must be positive")
    if ns.dp is not None and ns.dp < 1:
        errors.append(f"--dp {ns.dp} must be positive")
    if sp < 1 or (ns.nproc is not None and ns.nproc < 1) or (ns.dp is not None and ns.dp < 1):
        return max(1, world or ns.nproc or 1)
    nproc = world if world is not None else (ns.nproc if ns.nproc is not None else (ns.dp or 1) * sp)
    if ns.dp is not None and nproc != ns.dp * sp:
        errors.append(f"{where} {nproc} is not --dp {ns.dp} x --sp-size {sp}; give one of them, or make them agree")
    if ns.seq_len < 2:
        errors.append(f"--seq-len {ns.seq_len} is too short; a causal LM needs at least 2 tokens")
    if nproc % sp:
        errors.append(f"{where} {nproc} is not a multiple of --sp-size {sp}; each rank must be in one SP group")
    elif ns.batch_size >= 1 and ns.batch_size % (nproc // sp):
        errors.append(
            f"--batch-size {ns.batch_size} must be divisible by the {nproc // sp} SP groups "
            f"({where} {nproc} / --sp-size {sp}), which train on different rows"
        )
    if ns.backend == "none" and sp > 1:
        errors.append("--backend none runs without AutoSP, so it needs --sp-size 1")
    if ns.backend == "none" and ns.show_report:
        errors.append("--show-report prints AutoSP's report, and --backend none runs without AutoSP")
    if ns.deepspeed == 3:
        errors.append(parallel.ZERO3_REFUSAL)
    elif ns.deepspeed is not None and importlib.util.find_spec("deepspeed") is None:
        errors.append("--deepspeed needs the deepspeed package: pip install 'autosp-tools[deepspeed]'")
    if sp > 1:
        _check_variant(ns.variant, errors)
    return nproc


def _check_variant(name: str, errors: list[str]) -> None:
    from autosp import ConfigError
    from autosp.registry import get_registry

    try:
        get_registry().variant(name)
    except ConfigError as e:
        errors.append(f"--variant: {e}")


def _check_data(ns: argparse.Namespace, errors: list[str]) -> str:
    """Check --data against --seq-len; return the file's SHA-256 (a resume must train on the same bytes)."""
    path = Path(ns.data) if ns.data is not None else default_data_path()
    if not path.exists():
        errors.append(f"--data {path}: no such file")
        return ""
    if not path.is_file() or not os.access(path, os.R_OK):
        errors.append(f"--data {path}: not a readable file")
        return ""
    raw = path.read_bytes()
    if len(raw) == 0:
        errors.append(f"--data {path} is empty; give a file with text to train on")
    elif ns.seq_len >= 2 and len(raw) < ns.seq_len:
        errors.append(
            f"--data {path} has {len(raw)} bytes; each sequence of --seq-len {ns.seq_len} takes "
            f"{ns.seq_len - 1} bytes of it: give more data or a shorter --seq-len"
        )
    return hashlib.sha256(raw).hexdigest()


def _check_checkpoints(ns: argparse.Namespace, errors: list[str]) -> checkpoint.Resolved | None:
    if (ns.save_every or ns.stop_at) and not ns.checkpoint_dir:
        errors.append("--save-every/--stop-at write checkpoints: give --checkpoint-dir")
    if (ns.deepspeed is not None or ns.data_parallel == "fsdp") and (ns.checkpoint_dir or ns.resume):
        what = "--deepspeed" if ns.deepspeed is not None else "--data-parallel fsdp"
        errors.append(f"{what} keeps sharded optimizer state; --checkpoint-dir/--resume support only DDP for now")
    if ns.checkpoint_dir:
        d = Path(ns.checkpoint_dir)
        if d.exists() and not d.is_dir():
            errors.append(
                f"--checkpoint-dir {d} is a file, not a directory: give a directory (it is created if "
                "missing), so the first save does not fail after training"
            )
        else:
            # The nearest existing ancestor must let us create the directory and write in it.
            probe = d
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not probe.is_dir():
                errors.append(
                    f"--checkpoint-dir {d}: {probe} is a file, so the directory cannot be created; pick another path"
                )
            elif not os.access(probe, os.W_OK | os.X_OK):
                errors.append(
                    f"--checkpoint-dir {d}: {probe} is not writable, so saving would fail after "
                    "training; pick a directory you can write"
                )
    if ns.resume is None:
        return None
    try:
        return checkpoint.resolve(ns.resume, ns.checkpoint_dir)
    except checkpoint.CheckpointError as e:
        errors.append(str(e))
        return None


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Check the flags together, before any process starts; raise TrainConfigError listing every problem."""
    errors: list[str] = []
    dim, layers, heads, kv_heads, hidden = _model_dims(ns, errors)
    _check_numbers(ns, errors)
    nproc = _check_parallel(ns, heads, errors)
    impl = resolve_impl(ns.model_impl)
    if impl == "hf" and importlib.util.find_spec("transformers") is None:
        errors.append("--model-impl hf needs transformers: pip install transformers, or use --model-impl builtin")
    digest = _check_data(ns, errors)
    resolved = _check_checkpoints(ns, errors)
    try:
        fault = faults.from_env()
    except ValueError as e:
        errors.append(str(e))
    else:
        if fault is not None and ((fault.rank is not None and fault.rank >= nproc) or fault.step > ns.steps):
            errors.append(
                f"{faults.ENV}={os.environ[faults.ENV]} would never fire: this run has {nproc} rank(s) "
                f"and {ns.steps} step(s)"
            )
    if errors:
        raise TrainConfigError("\n".join(errors))

    warmup = ns.warmup if ns.warmup is not None else max(1, ns.steps // 10)
    return TrainConfig(
        model=ModelConfig(VOCAB_SIZE, dim, layers, heads, kv_heads, hidden, ns.seq_len, impl),
        seq_len=ns.seq_len,
        sp_size=ns.sp_size,
        nproc=nproc,
        data_parallel=ns.data_parallel,
        deepspeed=ns.deepspeed,
        variant=ns.variant,
        sac=SAC_CHOICES[ns.sac],
        backend=ns.backend,
        steps=ns.steps,
        batch_size=ns.batch_size,
        lr=ns.lr,
        min_lr_ratio=ns.min_lr_ratio,
        warmup=warmup,
        weight_decay=ns.weight_decay,
        grad_clip=ns.grad_clip,
        data=ns.data,
        seed=ns.seed,
        checkpoint_dir=ns.checkpoint_dir,
        resume=str(resolved.path) if resolved is not None and resolved.path is not None else None,
        save_every=ns.save_every,
        log_every=ns.log_every,
        stop_at=ns.stop_at,
        show_report=ns.show_report,
        quiet=ns.quiet,
        timeout=ns.timeout,
        data_sha256=digest,
        resume_notes=tuple(resolved.notes()) if resolved is not None else (),
    )


__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "SAC_CHOICES",
    "TrainConfig",
    "TrainConfigError",
    "build_parser",
    "config_from_args",
    "torchrun_world",
]
