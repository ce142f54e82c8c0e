"""The SP ranks hold the same parameters and buffers: when a compiled graph first runs, and at every call.

The contract assumes one model: each rank computes its piece of the sequence with the same
weights. Ranks whose weights differ (a model built without seeding every rank alike, a checkpoint
loaded on rank 0 only) still exchange pieces of the right shapes, so the SP program runs and
returns a loss that matches no single-device model: silently. DDP and DeepSpeed broadcast rank 0's
state when they wrap a model; ``autosp.compile`` alone does not. So the first run of every SP graph
compares the parameters and buffers it reads across the SP ranks, as the input check compares the
inputs: one all-gather of one digest, and a second, rich exchange only on a mismatch (every rank
saw the same digests, so every rank takes it). From equal weights the contract keeps the gradients
equal, but user code can still part them later (an optimizer stepped or a checkpoint loaded on some
ranks only): ``StateDigest`` carries the model's weights into every call's input check.

Each tensor is compared by a sample (``autosp.sample_digest``), read afresh at every call: an
evenly spread one and one element of every row, bitwise. Weights initialised or loaded differently
differ almost everywhere, rows added to a table differ in every element (``resize_token_embeddings``
on ranks seeded apart), and writes through ``.data`` move no version counter, so nothing is taken
for unchanged; the cost stays a few kernels per device, whatever the model's size.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autosp.errors import AutoSPError
from autosp.guards import naming_comm_failures
from autosp.input_check import collective_device
from autosp.sample_digest import sample_fingerprints
from autosp.torch_compat import all_gather_single
from autosp.weak_group import WeakGroup

_SHOWN = 5


class ParameterMismatch(AutoSPError):
    """The SP ranks hold different parameters or buffers: the SP program would match no single model."""


def state_name(placeholder: str) -> str:
    """``L_self_modules_layers_modules_0_modules_q_parameters_weight_`` -> ``layers.0.q.weight``;
    ``G_TABLE_`` -> ``TABLE (a global)``."""
    if placeholder.startswith("G_"):
        return f"{placeholder[2:].rstrip('_')} (a global)"
    name = re.sub(r"^L_(self_)?|_$", "", placeholder)
    name = re.sub(r"^(modules|parameters|buffers)_", "", name)
    return re.sub(r"_(modules|parameters|buffers)_", ".", name)


class ParameterCheck:
    """Compares named tensors across ``group``; raises ``ParameterMismatch`` on every rank if any differ."""

    group = WeakGroup()

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        group = self.group
        device = collective_device(group)
        fps = sample_fingerprints([t for _, t in named])
        digest = hash(tuple(fps)) if fps else 0  # one process's hash of ints: the same on every rank
        rows = torch.full((dist.get_world_size(group),), digest, dtype=torch.int64, device=device)
        all_gather_single(rows, rows[:1].clone(), group=group)
        if len(set(rows.tolist())) == 1:
            return
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [(name, fp) for (name, _), fp in zip(named, fps)], group=group)
        raise ParameterMismatch(mismatch_message(gathered, dist.get_process_group_ranks(group)))


def mismatch_message(
    gathered: list[list[tuple[str, int]]],
    ranks: list[int],
    holder: str = "that this graph reads",
    kind: str = "parameters or buffers",
) -> str:
    """Which tensors differ, and which ranks agree on each (``gathered[i]``: SP rank i's)."""
    tables = [dict(per_rank) for per_rank in gathered]
    names = list(tables[0])
    differ = [n for n in names if len({t.get(n) for t in tables}) > 1]
    lines = []
    for name in differ[:_SHOWN]:
        groups: dict[Any, list[int]] = {}
        for i, t in enumerate(tables):
            groups.setdefault(t.get(name), []).append(ranks[i])
        lines.append(
            f"  {name}: " + " / ".join(f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in groups.values())
        )
    if len(differ) > _SHOWN:
        lines.append(f"  ... and {len(differ) - _SHOWN} more of {len(names)}")
    if not differ:
        lines.append("  (their digests differ, each tensor's fingerprint agrees: a digest collision)")
    return (
        f"the SP ranks (global ranks {ranks}) hold different {kind}, {len(differ)} of "
        f"{len(names)} {holder}:\n" + "\n".join(lines) + "\n"
        "Every rank of an SP group computes its piece of the sequence with its own copy of the model, so the "
        "copies must be equal, or the result matches no single-device model. Seed every rank alike before "
        "building the model (torch.manual_seed), load the same checkpoint on every rank, or broadcast rank "
        "0's state (DDP and DeepSpeed do when they wrap the model); after the first call, step the optimizer and "
        "load checkpoints on every SP rank alike. A tensor made with torch.empty and only partly written "
        "differs between processes in the bytes never written: make it with torch.zeros. "
        "check_inputs='shapes' or 'off' skips this check."
    )


def check_state_on_first_run(
    fn: Callable[..., Any], names: Sequence[str], is_state: Sequence[bool], check: ParameterCheck
) -> Callable[..., Any]:
    """``fn`` (a compiled graph) compares its parameter and buffer inputs across the SP ranks once."""
    keep = [i for i, s in enumerate(is_state) if s]
    pending = True

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        nonlocal pending
        if pending:
            named = [(state_name(names[i]), args[i]) for i in keep if _plain_tensor(args[i])]
            with naming_comm_failures("the parameter check (a graph's first run)", check.group):
                check(named)
            pending = False
        return fn(*args)

    return run


class StateDigest:
    """Sample fingerprints of the model's parameters and buffers, for every call's input check.

    The first-run check covers a model built or loaded differently; weights can still part later:
    an optimizer stepped, or a checkpoint loaded, on some SP ranks only (through ``.data`` too).
    Those ranks would then run the SP program with other weights, silently. So each call's input
    check (its one all-gather, already paid) also carries a sample fingerprint of every parameter
    and buffer, read afresh: a few kernels per device, whatever the number of tensors.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def fingerprints(self) -> list[tuple[str, int]]:
        """(name, sample fingerprint) of every parameter and buffer, in the model's order."""
        named = [
            (name, t)
            for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]
            if _plain_tensor(t) and t.numel()
        ]
        return list(zip([n for n, _ in named], sample_fingerprints([t for _, t in named])))


def _plain_tensor(x: Any) -> bool:
    # A DTensor's local shard legitimately differs between ranks of the mesh it is sharded over.
    return isinstance(x, torch.Tensor) and type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type != "meta"


__all__ = [
    "ParameterCheck",
    "StateDigest",
    "ParameterMismatch",
    "check_state_on_first_run",
    "mismatch_message",
    "state_name",
]
