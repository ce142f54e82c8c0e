"""Test sharding rules against the unsharded op, with P ranks simulated in one process.

``check_op(op, args, placements=[...], world=P)`` is the rule-level oracle for rule and
plugin authors.  For one op it

1. runs the op on whole inputs in eager: the reference values and gradients;
2. builds the op's one-node graph (``meta["val"]`` from fake tensors, the node named ``"op"``);
3. on each of P ranks -- threads joined by torch's threaded process group, so the real
   collectives of ``autosp.sharding.collectives`` run, forward and backward -- gives every
   tensor input its piece for its placement (``Replicate``: the whole value; ``Shard``: this
   rank's intervals, by ``slice_to``; ``HeadShard``: this rank's block of the head dim;
   ``Partial``: a random summand ``c_r * x + n_r`` with ``sum c_r = 1``, ``sum n_r = 0``;
   whole numbers for an integer value),
   traces ``evaluate`` and ``finish`` under ``make_fx`` on fake tensors as ``autosp.shard``
   does, and runs the trace on the pieces;
4. checks every rank's whole outputs against the reference, and the gradients of
   ``sum(out * w)`` (``w`` random, the same on every rank) with respect to the whole inputs,
   *summed over the ranks*, against the reference gradients.  That sum is what AutoSP's
   gradient all-reduce makes of inputs that arrive whole on every rank, so the check holds a
   rule to the gradient convention of ``autosp.sharding.collectives``: gradients of
   ``Replicate`` values partial, of ``Shard``/``HeadShard`` values true on the local piece,
   of ``Partial`` values the true gradient (the random ``c_r`` expose a wrong share);
5. checks what later rules rely on: each output's local shape and dtype agree with its
   placement and global value, and all ranks issued the same collectives in the same order.

Layouts (``LAYOUTS``): ``even``, ``uneven`` (a slice's), ``zigzag``, ``zigzag_sliced`` and
``first_empty`` (rank 0 holds nothing); ``shard(dim, layout, length=S)`` folds the sequence
into a bigger dim (``[B * S, D]``), ``inner=`` puts faster factors after it.

``simulate(fn, world)`` is the P-thread runner underneath, for whole programs.
"""

from autosp.sharding.testing.check import OpReport, RuleMismatch, check_op
from autosp.sharding.testing.layouts import (
    LAYOUTS,
    LayoutFn,
    PlacementSpec,
    first_rank_empty_layout,
    head_shard,
    shard,
    sliced_layout,
    uneven_layout,
    zigzag_layout,
    zigzag_sliced_layout,
)
from autosp.sharding.testing.threads import SimulationError, collectives_issued, simulate

__all__ = [
    "LAYOUTS",
    "LayoutFn",
    "OpReport",
    "PlacementSpec",
    "RuleMismatch",
    "SimulationError",
    "check_op",
    "collectives_issued",
    "first_rank_empty_layout",
    "head_shard",
    "shard",
    "simulate",
    "sliced_layout",
    "uneven_layout",
    "zigzag_layout",
    "zigzag_sliced_layout",
]
