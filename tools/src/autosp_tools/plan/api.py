"""``plan(...)``: the Python entry point of ``autosp-plan`` (also ``autosp.plan``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autosp.errors import ConfigError
from autosp_tools.plan.capture import Mode
from autosp_tools.plan.hardware import resolve_device
from autosp_tools.plan.layout import Layout, state_bytes
from autosp_tools.plan.models import ModelSource, factory_source, resolve_model
from autosp_tools.plan.modes import default_modes
from autosp_tools.plan.planner import Estimate, Plan, check_seq, derive_auto, estimate, search_max_seq, timed_models

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_RESERVE = 0.08  # of device memory: CUDA context, allocator fragmentation, communication buffers
SEQ_CAP = 1 << 24


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def plan(
    model: str | ModelSource | Callable[..., nn.Module],
    *,
    gpus: int,
    hardware: str,
    dtype: str | torch.dtype = "bf16",
    sp: int | None = None,
    dp: int = 1,
    zero: int = 1,
    shard_over: str = "world",
    optimizer: str = "adamw",
    batch: int = 1,
    seq: int | None = None,
    max_seq: bool = False,
    memory_gb: float | None = None,
    reserve_gb: float | None = None,
    modes: Sequence[Mode] | None = None,
    layers: int | None = None,
) -> Plan:
    """Predict one rank's memory, communication, FLOPs and step time without running the model.

    Args:
        model: a preset name, an HF config.json path, ``module:factory``, a ``ModelSource``, or a
            callable returning a module whose ``forward(input_ids, labels)`` is the loss (with
            ``layers=``, a callable taking ``layers`` is compiled at 1 and 2 layers and scaled).
        gpus: GPUs in all; ``sp * dp`` must equal it.
        hardware: profile name (``h100-80gb``, ...) or ``autosp-profile`` JSON path.
        dtype: "bf16", "fp16" or "fp32" (parameters and activations; AdamW keeps fp32 master weights).
        sp: ranks sharing one sequence (default ``gpus // dp``).
        dp, zero, shard_over, optimizer: the rest of the layout (see ``Layout``); the default, ZeRO-1
            over all GPUs, is what DeepSpeed does with sequence parallelism.
        batch: sequences per step per SP group.
        seq: length to report (a multiple of ``sp``).
        max_seq: search the longest length that fits, per mode.
        memory_gb: device memory in GiB, overriding the profile's.
        reserve_gb: GiB kept free (default 8% of the device memory).
        modes: what to compare (default: ``modes.default_modes``).
        layers: layer count of a callable ``model`` that takes ``layers``.
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"gpus={gpus!r}: give a positive number of GPUs")
    sp = sp if sp is not None else gpus // dp
    layout = Layout(sp, dp, zero, shard_over, optimizer)
    if layout.gpus != gpus:
        raise ConfigError(f"sp={sp} x dp={dp} = {layout.gpus} GPUs, but gpus={gpus}; make sp * dp equal gpus")
    if batch < 1:
        raise ConfigError(f"batch={batch}: give at least 1")
    if seq is None and not max_seq:
        raise ConfigError("give a length (seq=..., --seq) or ask for the longest that fits (max_seq=True, --max-seq)")
    if seq is not None:
        check_seq(seq, layout)
    torch_dtype = _dtype(dtype)
    device = resolve_device(hardware, memory_gb)
    source = (
        model
        if isinstance(model, ModelSource)
        else (
            resolve_model(model)
            if isinstance(model, str)
            else factory_source(getattr(model, "__name__", "model"), model, layers)
        )
    )
    modes = list(modes) if modes is not None else default_modes(sp, source.heads, hardware)
    hint = seq if seq is not None else 4096 * sp
    models, params, counts, compile_s = timed_models(
        source,
        modes,
        sp=sp,
        dtype=torch_dtype,
        batch=batch,
        seq_hint=hint,
        spec=model if isinstance(model, str) else None,
    )
    reserve = reserve_gb * 2**30 if reserve_gb is not None else DEFAULT_RESERVE * device.memory_bytes
    p = Plan(
        source.name,
        source.layers,
        counts,
        params,
        str(torch_dtype).removeprefix("torch."),
        layout,
        device.name,
        device.memory_bytes,
        reserve,
        state_bytes(params, torch_dtype, layout),
        models,
        compile_s=compile_s,
    )
    if len(counts) == 2:
        p.notes.append(f"compiled with 1 and 2 layers; per-layer quantities scaled to {source.layers} layers")
    p.notes.append(
        "peak = parameters + optimizer state + the step's peak (activations, and gradients as the "
        "backward produces them, unsharded); ZeRO-2/3 shard gradients only after the step"
    )
    p.notes.append(
        "AutoSP rows use the min-cut partitioner as its Inductor path does; hand-written Ulysses keeps "
        "activations as eager does (SAC off, AOT's default partitioner)"
    )
    ok = [m for m in models if m.error is None]
    auto = _auto_pair(ok)

    def at(m_or_auto: Any, s: int) -> Estimate:
        if m_or_auto == "auto":
            off, on, name = auto  # type: ignore[misc]
            return derive_auto(p, off, on, s, torch_dtype, device, name)
        return estimate(p, m_or_auto, s, torch_dtype, device)

    rows: list[tuple[str, Any, int]] = [(m.mode.name, m, m.unit) for m in ok]
    if auto is not None:  # after SAC off and on: its search reads theirs
        rows.insert(2, (auto[2], "auto", auto[0].unit))
    if seq is not None:
        for _name, m, unit in rows:
            if seq % unit:
                continue
            p.estimates.append(at(m, seq))
    if max_seq:
        longest: dict[str, int] = {}
        for name, m, unit in rows:
            found, capped = search_max_seq(lambda s, m=m: at(m, s).fits, unit, SEQ_CAP)
            if m == "auto" and auto is not None and auto[1].mode.name in longest:
                # auto recomputes once the overhead falls under its threshold, so fitting is not monotone
                # in S: where SAC on fits longest and auto chooses it there, that is auto's longest too.
                on_seq = longest[auto[1].mode.name]
                if on_seq > found and "recompute" in at(m, on_seq).note:
                    found, capped = on_seq, p.max_seq[auto[1].mode.name]["capped"]
            longest[name] = found
            e = at(m, found) if found else None
            p.max_seq[name] = {"seq": found, "capped": capped, "estimate": e.as_dict() if e else None}
            top = max(found, unit * 4) * 2
            points = sorted({max(unit, (top * i // 16) // unit * unit) for i in range(1, 17)})
            p.curves[name] = [(s, at(m, s).total_bytes) for s in points]
    for m in models:
        if m.error:
            p.notes.append(f"{m.mode.name}: not possible here: {m.error}")
    return p


def _auto_pair(models: Sequence[Any]) -> tuple[Any, Any, str] | None:
    """SAC off and on of the first variant (or of the single device): what SAC "auto" chooses between."""
    offs = [m for m in models if m.mode.sac is False and not m.mode.handwritten]
    for off in offs:
        on = next(
            (
                m
                for m in models
                if m.mode.sac is True
                and m.mode.variant == off.mode.variant
                and m.mode.variant_options == off.mode.variant_options
            ),
            None,
        )
        if on is not None:
            name = off.mode.name.replace("SAC off", "SAC auto")
            return off, on, name
    return None


__all__ = ["DTYPES", "plan"]
