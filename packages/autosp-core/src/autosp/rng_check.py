"""The SP ranks draw the same random numbers when a graph of theirs draws any.

A random op in an SP graph draws the whole tensor on every rank and each rank keeps its part (the
sharding rules treat the draw as a replicated value), so with every rank's generator in the same
state the masks are the single-device program's. Ranks seeded apart (``seed + rank``, common in
data-parallel code) each draw their own: a value the SP program holds as one differs between
ranks (a dropout mask multiplied into a partial sum, a mask on a pooled vector), and the result
matches no run of the model, silently. So the input check carries a digest of each rank's
generator states in its one all-gather, and a graph that draws random numbers refuses to run when
the last check saw them differ. Programs that draw none are not refused: their ranks may be seeded
as the user likes.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autosp.analysis.source import user_line
from autosp.errors import AutoSPError
from autosp.user_function import BODIES, USER_FUNCTION

# The generators the digest covers: torch's (ROCm's is torch.cuda's), Python's ``random``, whose
# draws in a forward Dynamo makes graph inputs (``random_value_0``) that no input check sees, and
# NumPy's global one, drawn only in code Dynamo runs in eager (BigBird's random blocks, Wav2Vec2's
# SpecAugment masks): no graph shows those draws, so ``refuse_eager_draws`` looks after the call.
DEVICE_TYPES = ("cpu", "cuda", "python", "numpy")
_PYTHON_DRAW = re.compile(r"random_value_\d+")


class RandomStateMismatch(AutoSPError):
    """The SP ranks hold different RNG states and the program draws random numbers."""


def digest_bytes(data: bytes) -> int:
    """A signed 64-bit digest, the same in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def state_digest(state: torch.Tensor) -> int:
    """A digest of a generator's state (``torch.Generator.get_state()``, a uint8 tensor)."""
    # A generator state is a uint8 tensor: read through a list (numpy, which torch does not
    # require, may be absent), as int64 words where the size allows (8x fewer elements).
    if state.numel() % 8 == 0:
        words = state.view(torch.int64).tolist()
        return digest_bytes(struct.pack(f"<{len(words)}q", *words))
    return digest_bytes(bytes(state.tolist()))


def rng_digests() -> list[int]:
    """One int64 per ``DEVICE_TYPES`` entry: this process's default generator states (0: not in use)."""
    cuda = state_digest(torch.cuda.get_rng_state()) if torch.cuda.is_initialized() else 0
    return [state_digest(torch.get_rng_state()), cuda, _python_digest(), _numpy_digest()]


def _numpy_digest() -> int:
    np = sys.modules.get("numpy")  # not imported: nothing can have drawn from it
    if np is None:
        return 0
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return digest_bytes(keys.tobytes() + struct.pack("<qqd", pos, has_gauss, gauss))


def _python_digest() -> int:
    version, words, gauss = random.getstate()
    # hash() of ints and floats is the same in every process (that of str is salted per process):
    # 10x faster than a digest of the state's text, on every call.
    return hash((version, words, -1.0 if gauss is None else gauss))


def _draws(node: torch.fx.Node, target: torch._ops.OpOverload) -> bool:
    # Attention kernels are tagged for their dropout: they draw only with dropout_p > 0.
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value or 0.0)
            return not isinstance(p, (int, float)) or p != 0
    return True


def random_ops(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``(device type, description)`` of every node of ``gm`` that draws random numbers."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target is USER_FUNCTION:
            # Opaque to this graph: its forward's draws were read when it was made (autosp.user_function).
            where = user_line(node) or node.name
            vals = node.meta.get("val") or []
            device = vals[0].device.type if vals and isinstance(vals[0], torch.Tensor) else "cpu"
            found += [
                (device, f"{op} in a custom torch.autograd.Function ({where})") for op in BODIES[node.args[1]].draws
            ]
            continue
        if torch.Tag.nondeterministic_seeded not in target.tags or not _draws(node, target):
            continue
        val = node.meta.get("val")
        device = val.device.type if isinstance(val, torch.Tensor) else "cpu"
        found.append((device, f"{target.name()} ({user_line(node) or node.name})"))
    return found


def python_draws(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``("python", description)`` per value Dynamo drew from Python's ``random`` for ``gm`` (its
    ``random_value_N`` inputs, computed before each run), as ``random_ops`` describes ops."""
    return [
        ("python", f"a call of Python's random module (the graph's input {node.target})")
        for node in gm.graph.nodes
        if node.op == "placeholder" and _PYTHON_DRAW.fullmatch(str(node.target))
    ]


_GENERATORS = {"python": ("Python random module", "random.seed"), "numpy": ("NumPy global random", "np.random.seed")}


def split_message(what: str, ops: Sequence[tuple[str, str]], device: str, groups: list[list[int]]) -> str:
    ranks = " / ".join(("rank " if len(g) == 1 else "ranks ") + ", ".join(map(str, g)) for g in groups)
    generators, seed = _GENERATORS.get(device, (f"{device} random number generator", "torch.manual_seed"))
    return (
        f"the SP ranks hold different {generators} states ({ranks}; global ranks), and "
        f"{what} draws random numbers: {ops[0][1]}" + (f" and {len(ops) - 1} more" if len(ops) > 1 else "") + ". "
        "Each rank would draw its own numbers for values the SP program holds as one, and the result would "
        f"match no single-device run. Seed every rank of an SP group alike: {seed}(seed + dp_rank) "
        "with dp_rank = global_rank // sp_size, not seed + global_rank (transformers.set_seed seeds torch, "
        "NumPy and random at once; check_inputs='off' skips this check)."
    )


def refuse_eager_draws(before: Sequence[int], split: Callable[[str], list[list[int]]]) -> None:
    """After a call: raise when it advanced a generator whose state the ranks held apart at its check.

    Graphs' draws are refused before they run (``refuse_divergent_rng``); code Dynamo runs in eager
    (NumPy, a ``torch.compiler.disable``'d function) draws where no graph shows it, and the state moved
    is the only trace. Every rank ran the same program on the same inputs, so every rank drew or none
    did, and every rank raises alike. ``before``: this rank's ``rng_digests()`` at the call's check.
    """
    apart = [d for d in DEVICE_TYPES if len(split(d)) > 1]
    if not apart:  # the usual case: nothing to read after the call
        return
    now = dict(zip(DEVICE_TYPES, rng_digests()))
    for device in apart:
        if now[device] != before[DEVICE_TYPES.index(device)]:
            what = "this call, in code that runs outside the compiled graphs (in eager),"
            drew = [(device, "its global generator moved during the call")]
            raise RandomStateMismatch(split_message(what, drew, device, split(device)))


def refuse_divergent_rng(
    fn: Callable[..., Any], ops: Sequence[tuple[str, str]], split: Callable[[str], list[list[int]]], what: str
) -> Callable[..., Any]:
    """``fn`` (a graph drawing ``ops``) raises, on every rank alike, when ``split`` names differing ranks.

    ``split(device)`` reads the last input check's gathered digests, which every rank saw the same,
    so every rank raises or none does, with no collective of its own.
    """
    devices = sorted({d for d, _ in ops if d in DEVICE_TYPES})

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        for device in devices:
            groups = split(device)
            if len(groups) > 1:
                raise RandomStateMismatch(split_message(what, [o for o in ops if o[0] == device], device, groups))
        return fn(*args)

    return run


__all__ = [
    "DEVICE_TYPES",
    "RandomStateMismatch",
    "digest_bytes",
    "python_draws",
    "random_ops",
    "refuse_divergent_rng",
    "refuse_eager_draws",
    "rng_digests",
    "split_message",
    "state_digest",
]
