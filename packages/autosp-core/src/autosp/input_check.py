"""The SP ranks agree on their inputs before an SP program runs.

The contract is that every rank of the SP group calls the compiled program with the same
full-length inputs. Ranks fed different batches produce a loss that matches no single-device run
(same shapes), a silently wrong program (``[2, 64]`` against ``[1, 128]``) or a collective of
mismatched sizes (a C++ abort in gloo). So each call first exchanges one fixed-size digest of the
inputs: a fixed size, because a check that ran only when one rank's shapes changed would leave the
other ranks in the SP program's first collective, paired with the wrong one.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from autosp import peer_failure
from autosp.rng_check import DEVICE_TYPES, digest_bytes, rng_digests, state_digest
from autosp.torch_compat import all_gather_single
from autosp.weak_group import WeakGroup

CheckMode = Literal["tokens", "shapes", "hash", "off"]
CHECK_MODES: tuple[str, ...] = ("tokens", "shapes", "hash", "off")


_SAMPLE = 1 << 16  # floating-point elements the default mode compares per tensor


def compared(t: torch.Tensor, mode: str) -> torch.Tensor | None:
    """What of ``t``'s contents ``mode`` compares across the SP ranks (``None``: nothing).

    "hash": all of it. "tokens" (the default): all of an integer or boolean tensor (token ids,
    labels, masks, positions) and an evenly spread sample of at most 65,536 elements of a
    floating-point one (embeddings, pixel values, features: often large), which a data loader
    that gives the ranks of one SP group different rows changes almost everywhere. "shapes" and
    "off": nothing.
    """
    if mode == "hash" or (mode == "tokens" and not (t.is_floating_point() or t.is_complex())):
        return t
    if mode != "tokens":
        return None
    return spread_sample(t, _SAMPLE)


def spread_sample(t: torch.Tensor, limit: int) -> torch.Tensor:
    """At most ``limit`` elements of ``t``, evenly spread over it (all of them when it is small)."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= limit:
        return flat
    step = -(-flat.numel() // limit)
    # A step sharing no factor with the last dimension: the sample crosses every feature column,
    # not only the ones a multiple of it would land on (a constant padding feature, say).
    last = t.shape[-1]
    while math.gcd(step, last) != 1:
        step += 1
    return flat[::step]


_MAX_DEPTH = 8
_CHUNK = 1 << 16  # elements hashed at once: bounded temporaries, cached weights (512 KiB per device)
_MULT = 0x5851F42D4C957F2D  # odd 64-bit constants (PCG's multiplier and increment)
_ADD = 0x14057B7EF767814F


@dataclass(frozen=True)
class Leaf:
    """One input of a call: where it sits in the arguments and what every rank must agree on.

    Attributes:
        path: the argument it came from, as the caller wrote it (``input_ids``, ``batch['labels']``).
        meta: shape, dtype and device type of a tensor, or the value of a plain scalar.
        tensor: the tensor (``None`` for other values), for the content fingerprint.
    """

    path: str
    meta: str
    tensor: torch.Tensor | None = None


def tensor_meta(t: torch.Tensor) -> str:
    # Device type only: SP ranks on one host legitimately use cuda:0 and cuda:1. Strides when not
    # contiguous: Dynamo guards on them, so ranks with other layouts would compile other graphs.
    grad = " requires_grad" if t.requires_grad else ""
    strides = "" if t.is_contiguous() else f" strides {list(t.stride())}"
    return f"tensor {list(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device.type}{grad}{strides}"


def _scalar_meta(value: Any) -> str | None:
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, torch.dtype):
        return f"dtype {value}"
    if isinstance(value, torch.device):
        return f"device {value.type}"
    return None


def _walk(value: Any, path: str, out: list[Leaf], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        # Parameters are the model's, not the batch's; replicated by construction.
        if not isinstance(value, torch.nn.Parameter):
            out.append(Leaf(path, tensor_meta(value), value))
        return
    if isinstance(value, torch.Generator):
        # Dynamo draws from a passed generator in eager (a graph break): ranks holding it in other
        # states would each draw their own numbers for one value of the program. Its state is the input.
        out.append(Leaf(path, f"generator {value.device.type} state {state_digest(value.get_state()):x}"))
        return
    scalar = _scalar_meta(value)
    if scalar is not None:
        out.append(Leaf(path, scalar))
        return
    if depth < _MAX_DEPTH:
        if isinstance(value, Mapping):
            # Sorted: two ranks that build the same dict in another order agree.
            for key in sorted(value, key=repr):
                _walk(value[key], f"{path}[{key!r}]", out, depth + 1)
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _walk(item, f"{path}[{i}]", out, depth + 1)
            return
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                _walk(getattr(value, f.name), f"{path}.{f.name}", out, depth + 1)
            return
        attributes = _plain_attributes(value)
        if attributes is not None:
            # A config object (SimpleNamespace, a class of settings): Dynamo reads and guards on its
            # attributes, so ranks holding other values would run other programs.
            out.append(Leaf(path, f"object {type(value).__qualname__}"))
            for key in sorted(attributes):
                _walk(attributes[key], f"{path}.{key}", out, depth + 1)
            return
    # Anything else is compared by type only (its repr may hold addresses that differ per process).
    out.append(Leaf(path, f"object {type(value).__qualname__}"))


_MAX_ATTRIBUTES = 64


def _plain_attributes(value: Any) -> dict[str, Any] | None:
    """The instance attributes of a small plain object; None for modules, functions, classes and large ones."""
    if isinstance(value, (torch.nn.Module, type)) or callable(value):
        return None
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or len(attributes) > _MAX_ATTRIBUTES:
        return None
    return {k: v for k, v in attributes.items() if isinstance(k, str) and not k.startswith("__")}


def program_state(model: Any) -> list[Leaf]:
    """What Dynamo guards on besides the inputs, which ranks could differ in: the grad mode, autocast,
    and the model's train()/eval() flags and trainable parameters (one rank in eval() with dropout on
    would otherwise run another program)."""
    # Inference mode compiles its own graph too (Dynamo guards on it), apart from no_grad.
    grad = f"enabled {torch.is_grad_enabled()}"
    leaves = [Leaf("(grad mode)", f"{grad}, inference mode" if torch.is_inference_mode_enabled() else grad)]
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            leaves.append(Leaf(f"(autocast {device})", f"dtype {torch.get_autocast_dtype(device)}"))
    if isinstance(model, torch.nn.Module):
        modes = bytes(m.training for m in model.modules())
        trainable = bytes(p.requires_grad for p in model.parameters())
        leaves.append(Leaf("(model)", f"train() flags {digest_bytes(modes)}, requires_grad {digest_bytes(trainable)}"))
    return leaves


def signature_of(fn: Any) -> inspect.Signature | None:
    """The signature calls are bound to, so inputs are named as the model names them."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def flatten_inputs(
    args: Sequence[Any], kwargs: Mapping[str, Any], signature: inspect.Signature | None = None
) -> list[Leaf]:
    """Every input of one call, parameters excluded, named by argument and position inside it."""
    named: list[tuple[str, Any]]
    try:
        if signature is None:
            raise TypeError
        bound = signature.bind(*args, **kwargs)
        named = []
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named.extend((f"{name}[{i}]", v) for i, v in enumerate(value))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.extend((k, value[k]) for k in sorted(value))
            else:
                named.append((name, value))
    except TypeError:
        # The model will raise its own error for a call that does not bind; name by position meanwhile.
        named = [(f"args[{i}]", v) for i, v in enumerate(args)] + [(k, kwargs[k]) for k in sorted(kwargs)]
    out: list[Leaf] = []
    for name, value in named:
        _walk(value, name, out, 0)
    return _name_repeats(out)


def _name_repeats(leaves: list[Leaf]) -> list[Leaf]:
    """A tensor passed twice (``labels=input_ids``) is one graph input to Dynamo, two on a rank given a
    copy: the ranks would compile other graphs, so the repeat is part of what they compare."""
    first: dict[int, str] = {}
    for i, leaf in enumerate(leaves):
        if leaf.tensor is None:
            continue
        seen = first.setdefault(id(leaf.tensor), leaf.path)
        if seen != leaf.path:
            leaves[i] = Leaf(leaf.path, f"{leaf.meta} (the same tensor as {seen})", leaf.tensor)
    return leaves


_weights: dict[torch.device, torch.Tensor] = {}


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """Odd pseudo-random int64 weights for positions inside a chunk, made once per device."""
    w = _weights.get(device)
    if w is None:
        w = torch.arange(_CHUNK, dtype=torch.int64, device=device) * _MULT + _ADD
        w = (w ^ (w >> 29)) | 1
        _weights[device] = w
    return w


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of a tensor's bytes, computed where the tensor lives (int64, 0-dim).

    Position-weighted with odd weights in wrapping int64 arithmetic, so a changed element always
    changes it and swapped tokens almost always do (XOR-style hashes such as ``torch.hash_tensor``
    miss swaps). Chunks get their own odd multiplier, so the weights are made once per device.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[x.element_size()]
    x = x.view(word)
    weights = _chunk_weights(x.device)
    total = torch.full((), x.numel(), dtype=torch.int64, device=x.device)
    for k, start in enumerate(range(0, x.numel(), _CHUNK)):
        words = x[start : start + _CHUNK]
        part = (words * weights[: words.numel()]).sum()  # int64: promotion, products wrap mod 2**64
        total += part * (((k * _MULT + _ADD) & 0x7FFFFFFFFFFFFFFF) | 1) if k else part
    return total


def collective_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def mismatch_message(gathered: list[list[tuple[str, str, int | None]]], ranks: list[int]) -> str:
    """What differs between the ranks' inputs, input by input (``gathered[i]``: SP rank i's inputs)."""
    paths: list[str] = []
    for per_rank in gathered:
        paths.extend(p for p, _, _ in per_rank if p not in paths)
    tables = [{p: (m, fp) for p, m, fp in per_rank} for per_rank in gathered]
    lines = []
    for path in paths:
        metas = [t.get(path, ("missing", None))[0] for t in tables]
        if len(set(metas)) > 1:
            groups: dict[str, list[int]] = {}
            for i, m in enumerate(metas):
                groups.setdefault(m, []).append(ranks[i])
            lines.append(f"  {path}: " + "; ".join(f"{_ranks_text(rs)}: {m}" for m, rs in groups.items()))
            continue
        fps = [t[path][1] for t in tables]
        if len(set(fps)) > 1:
            groups_fp: dict[int | None, list[int]] = {}
            for i, fp in enumerate(fps):
                groups_fp.setdefault(fp, []).append(ranks[i])
            lines.append(
                f"  {path} ({metas[0]}): different contents: "
                + " / ".join(_ranks_text(rs) for rs in groups_fp.values())
            )
    if not lines:  # digests differed but the descriptions agree: a digest collision, or a rank's own bug
        lines.append("  (the inputs' digests differ, their descriptions agree)")
    state = any(line.startswith("  (") for line in lines)
    return (
        "the ranks of the SP group were called with different inputs (global ranks):\n" + "\n".join(lines) + "\n"
        "Every rank of an SP group must call the compiled model with the same full-length batch: AutoSP splits "
        "the sequence itself. Give all ranks of one SP group the same batch (shard the data loader over the "
        "data-parallel group only, and seed it the same way on the SP ranks)."
        + (
            " And call it in the same state on every SP rank: the same torch.no_grad()/autocast context, the "
            "same train()/eval() mode and the same frozen parameters (Dynamo would compile another program "
            "on the ranks that differ)."
            if state
            else ""
        )
    )


class InputMismatchError(RuntimeError):
    """Raised (wrapped into ``AutoSPError`` by the caller) with ``mismatch_message``'s text."""


class StateMismatchError(RuntimeError):
    """The inputs agree, the model's parameters or buffers do not (wrapped into ``ParameterMismatch``).

    ``gathered[i]``: SP rank i's ``(name, sample fingerprint)`` list; ``ranks``: their global ranks.
    """

    def __init__(self, gathered: list[Any], ranks: list[int]) -> None:
        super().__init__("the SP ranks hold different parameters or buffers")
        self.gathered, self.ranks = gathered, ranks


class StepMismatchError(RuntimeError):
    """Some SP ranks are in a backward while others called the forward (wrapped into ``StepMismatch``)."""

    def __init__(self, backward: list[int], forward: list[int]) -> None:
        super().__init__(
            f"the SP ranks are at different steps of the compiled program: global ranks {backward} are in its "
            f"backward while global ranks {forward} called it (a forward). Every rank must run the same forwards "
            "and backwards in the same order, or one rank's collectives meet another's: an evaluation or a "
            "backward on some ranks only (if rank == 0: ...) does that. Evaluate on every rank, or on one rank "
            "with the model itself (not the compiled one), which runs no collective."
        )


class GradientMismatchError(RuntimeError):
    """The gradients flowing into a backward differ between the SP ranks (wrapped into ``GradientMismatch``)."""

    def __init__(self, groups: list[list[int]]) -> None:
        apart = " / ".join(f"global ranks {g}" for g in groups)
        super().__init__(
            f"the gradient flowing into the compiled program's backward differs between the SP ranks ({apart}). "
            "Every rank returns the same outputs, so every rank must backpropagate the same function of them: "
            "the same loss, scaled alike (a micro-batch or token count that differs per rank, a loss weight), "
            "computed from the same labels (not a per-rank shard of them). Otherwise each rank's gradients are "
            "those of another loss, and none is the single-device gradient."
        )


# Relative difference of the incoming gradient's statistics that counts as different: far above
# the order-of-summation noise of a nondeterministic kernel computing the loss from the outputs.
_GRAD_RTOL = 1e-5


def _gradient_stats(grad: torch.Tensor | None) -> list[float]:
    """Three float64 sums over a spread sample of ``grad``: plain, squared, position-weighted."""
    if grad is None or grad.numel() == 0:
        return [0.0, 0.0, 0.0]
    x = spread_sample(grad, _SAMPLE).to(torch.float64)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    w = torch.cos(torch.arange(x.numel(), dtype=torch.float64, device=x.device) * 0.618)
    return torch.stack([x.sum(), x.square().sum(), (x * w).sum()]).tolist()


def _close(a: float, b: float) -> bool:
    # NaN and inf on every rank (a diverged loss) agree, as eager would carry them on.
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= _GRAD_RTOL * max(abs(a), abs(b))


def _stats_apart(rows: list[list[float]]) -> list[list[int]]:
    """Indices of the ranks grouped by statistics equal within ``_GRAD_RTOL`` (one group: they agree)."""
    groups: list[list[int]] = []
    for i, row in enumerate(rows):
        for g in groups:
            ref = rows[g[0]]
            if all(_close(a, b) for a, b in zip(row, ref)):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


# The first int64 of a backward's row: the same all-gather as a forward's input check, so a rank in
# a backward and a rank at a forward meet in it and both see the difference, instead of pairing
# their programs' collectives (a hang until the timeout).
BACKWARD_MARK = -0x4241434B57415244


class InputCheck:
    """One all-gather of a fixed-size digest per call; a second, rich exchange only on a mismatch.

    The second exchange is safe: every rank saw the same gathered digests, so every rank takes it.
    Each backward through a call's outputs begins with the same all-gather, marked (``backward``).
    """

    group = WeakGroup()

    def __init__(self, group: Any, mode: CheckMode) -> None:
        self.group = group
        self.mode = mode
        self.ranks = dist.get_process_group_ranks(group)
        self.device = collective_device(group)
        # Per generator (``rng_check.DEVICE_TYPES``), each rank's digest at the last check, and this rank's.
        self.rng_rows: list[list[int]] = []
        self.rng_mine: list[int] = []

    def rng_split(self, device: str) -> list[list[int]]:
        """Global ranks grouped by their ``device`` generator's state at the last check (one group: agreed)."""
        k = DEVICE_TYPES.index(device)
        groups: dict[int, list[int]] = {}
        for rank, row in zip(self.ranks, self.rng_rows):
            groups.setdefault(row[k], []).append(rank)
        return list(groups.values())

    def __call__(self, leaves: list[Leaf], state: list[tuple[str, int]] | None = None) -> None:
        """``state``: the model's parameters and buffers (``param_check.StateDigest``), compared after the inputs."""
        # The mode itself is compared first: ranks comparing contents differently would otherwise
        # report contents that differ where only the check does.
        leaves = [Leaf("(check_inputs)", repr(self.mode)), *leaves]
        digest = digest_bytes("\n".join(f"{leaf.path}: {leaf.meta}" for leaf in leaves).encode())
        state_digest = digest_bytes(repr(state).encode()) if state else 0
        # The generators' digests ride along; rng_check decides whether they must agree.
        local = torch.tensor([digest, 0, state_digest, *rng_digests()], dtype=torch.int64, device=self.device)
        fps: torch.Tensor | None = None
        contents = [None if leaf.tensor is None else compared(leaf.tensor, self.mode) for leaf in leaves]
        tensors = [c for c in contents if c is not None]
        if tensors:
            fps = torch.stack([fingerprint(t).to(self.device) for t in tensors])
            weights = torch.arange(len(tensors), dtype=torch.int64, device=self.device) * _MULT + _ADD
            local[1] = (fps * (weights | 1)).sum()
        # Pre-filled with our own row: a backend that does not communicate (fake) compares equal.
        rows = local.repeat(len(self.ranks))
        peer_failure.wait(all_gather_single(rows, local, group=self.group, async_op=True), self.group, local.device)
        width = local.numel()
        flat = rows.tolist()
        self._refuse_steps_apart(flat, width)
        self.rng_rows = [flat[i + 3 : i + width] for i in range(0, len(flat), width)]
        self.rng_mine = local[3:].tolist()
        values = [flat[i : i + 2] for i in range(0, len(flat), width)]
        if all(v == values[0] for v in values):
            if len({flat[i + 2] for i in range(0, len(flat), width)}) > 1:
                gathered_state: list[Any] = [None] * len(self.ranks)
                dist.all_gather_object(gathered_state, state or [], group=self.group)
                raise StateMismatchError(gathered_state, self.ranks)
            return
        fp_iter = iter(fps.tolist() if fps is not None else [])
        mine = [
            (leaf.path, leaf.meta, None if c is None else next(fp_iter))
            for leaf, c in zip(leaves, contents, strict=True)
        ]
        gathered: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(gathered, mine, group=self.group)
        raise InputMismatchError(mismatch_message(gathered, self.ranks))

    def backward(self, grad: torch.Tensor | None) -> None:
        """At the start of a backward through a checked call's outputs: every rank must be in one
        too, with the same incoming gradient (``grad``, the first output's to arrive)."""
        width = 3 + len(DEVICE_TYPES)  # a forward's row: digest, contents, state, the generators
        stats = torch.tensor(_gradient_stats(grad), dtype=torch.float64)
        local = torch.zeros(width, dtype=torch.int64)
        local[0] = BACKWARD_MARK
        local[1:4] = stats.view(torch.int64)  # the float64 sums' bits ride in the int64 row
        local = local.to(self.device)
        rows = local.repeat(len(self.ranks))
        peer_failure.wait(all_gather_single(rows, local, group=self.group, async_op=True), self.group, local.device)
        table = rows.cpu().view(len(self.ranks), width)
        self._refuse_steps_apart(table.reshape(-1).tolist(), width)
        groups = _stats_apart(table[:, 1:4].contiguous().view(torch.float64).tolist())
        if len(groups) > 1:
            raise GradientMismatchError([[self.ranks[i] for i in g] for g in groups])

    def _refuse_steps_apart(self, flat: list[int], width: int) -> None:
        marked = [flat[i] == BACKWARD_MARK for i in range(0, len(flat), width)]
        if any(marked) and not all(marked):
            raise StepMismatchError(
                [r for r, m in zip(self.ranks, marked) if m], [r for r, m in zip(self.ranks, marked) if not m]
            )


__all__ = [
    "BACKWARD_MARK",
    "CHECK_MODES",
    "CheckMode",
    "GradientMismatchError",
    "InputCheck",
    "InputMismatchError",
    "StateMismatchError",
    "StepMismatchError",
    "Leaf",
    "collective_device",
    "compared",
    "fingerprint",
    "flatten_inputs",
    "mismatch_message",
    "program_state",
    "signature_of",
    "spread_sample",
    "tensor_meta",
]
