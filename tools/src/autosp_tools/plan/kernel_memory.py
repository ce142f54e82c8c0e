"""Scratch memory that attention kernels allocate inside their ops, besides their outputs.

The liveness walk sees an op's outputs; a kernel's own buffers are allocations too (the CPU
allocator's profiler events and CUDA's ``memory_allocated`` count them), live while it runs.

CPU, ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`` (the kernel of
``_scaled_dot_product_flash_attention_for_cpu`` and its backward): queries are cut in blocks of
qSplit rows (256, 64 or 32 for query lengths >= 768, >= 192 or less) and keys in blocks of 512,
both capped at the lengths, and every thread keeps its blocks in the accumulation type (fp32):

* forward: ``buf`` [threads, qSplit*kvSplit (qk) + 2*qSplit (max, sum) + qSplit*D (dst)], and for
  bf16/fp16 ``buf_reduced`` [threads, qSplit, kvSplit] in the input dtype;
* backward: ``buf`` [threads, 2*qSplit*kvSplit] (attn, grad_attn), for bf16/fp16 ``buf_reduced`` of
  as many elements in the input dtype, ``dsum`` [qSplit] per thread, and ``grad_out.contiguous()``
  of the [B, S, H, D] view of the incoming gradient when that view is strided.

GPU attention kernels' workspaces are not modelled (which kernel SDPA picks depends on the GPU and
the PyTorch build); the plan's reserve covers them.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from autosp_tools.plan.runtime import Runtime
from autosp_tools.plan.sizes import shape_exprs

ZERO = sympy.Integer(0)
_CPU_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
_CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _blocks(q_len: sympy.Expr, kv_len: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    q_split = sympy.Piecewise((256, q_len >= 768), (64, q_len >= 192), (32, True))
    return sympy.Min(q_split, q_len), sympy.Min(512, kv_len)


def _strided_after_transpose(val: object) -> bool:
    try:
        return isinstance(val, torch.Tensor) and not bool(val.transpose(1, 2).is_contiguous())
    except Exception:  # noqa: BLE001 - a symbolic stride it cannot decide: assume no copy
        return False


def scratch(node: fx.Node, runtime: Runtime) -> sympy.Expr:
    """Bytes an attention kernel allocates for itself while ``node`` runs on ``runtime`` (0 if none known)."""
    if runtime.device != "cpu" or node.op != "call_function":
        return ZERO
    name = str(node.target)
    if name not in (_CPU_FORWARD, _CPU_BACKWARD):
        return ZERO
    backward = name == _CPU_BACKWARD
    first = 1 if backward else 0
    q, k = _val(node.args[first]), _val(node.args[first + 1])
    q_shape, k_shape = shape_exprs(q), shape_exprs(k)
    if len(q_shape) != 4 or len(k_shape) != 4 or not isinstance(q, torch.Tensor):
        return ZERO
    q_split, kv_split = _blocks(q_shape[2], k_shape[2])
    threads = runtime.threads
    reduced = q.dtype in (torch.bfloat16, torch.float16)
    size = q.element_size()
    if not backward:
        per_thread = q_split * kv_split + 2 * q_split + q_split * q_shape[3]
        return threads * (4 * per_thread + (size * q_split * kv_split if reduced else 0))
    per_thread = 2 * q_split * kv_split
    total = threads * (4 * per_thread + (size * per_thread if reduced else 0) + 4 * q_split)
    grad_out = _val(node.args[0])
    if _strided_after_transpose(grad_out):
        total += sympy.Mul(*shape_exprs(grad_out)) * size
    return total


__all__ = ["scratch"]
