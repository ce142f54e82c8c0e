"""User options of one AutoSP compile, checked before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from autosp.errors import ConfigError
from autosp.hardware_select import HardwareOption, check_option
from autosp.input_check import CHECK_MODES, CheckMode
from autosp.option_agreement import agree, options_of
from autosp.weak_group import WeakGroup, weak_repr

Backend = Literal["inductor", "aot_eager", "eager"]
BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True, repr=False)
class SPOptions:
    """Options of ``autosp.compile`` / ``autosp.backend``.

    Attributes:
        sp_size: ranks that share one sequence; ``None`` means the size of ``group``.
        variant: SP variant, provided by a plugin package ("ulysses", "ring", ...).
        sac: activation checkpointing: "auto" (cost model), True (save most memory), False (default partitioner).
        group: the SP process group; ``None`` means the default group, or consecutive
            subgroups of ``sp_size`` ranks when ``sp_size`` is smaller than the world.
        backend: compiler that runs after the AutoSP passes.
        disable_passes: names of passes to skip.
        grad_bucket_mb: gradients are all-reduced in buckets of at most this many MiB
            (0: one collective per gradient).
        variant_options: options the variant reads (for example ``ulysses_degree``).
        check_inputs: what the SP ranks compare before each call (one small all-gather): "tokens"
            (the default: shapes, dtypes and scalar values of every non-parameter input, the
            contents of its integer and boolean tensors: token ids, labels, masks, positions, and
            65,536 evenly spread elements of each floating-point one), "shapes" (no contents),
            "hash" (all the contents of every input tensor) or "off" (``False`` means "off",
            ``True`` "tokens"). With "tokens" and "hash" the first run of each graph also
            compares a sample of every parameter and buffer it reads, and every call a sample of
            every parameter and buffer of the model (``autosp.param_check``).
        timeout: seconds (or a ``timedelta``) after which a collective of AutoSP fails when
            another SP rank does not take part; AutoSP creates its SP group with it. Compiles
            do not count: each compile ends with the ranks agreeing on it, on the world's
            timeout (``autosp.compile_agreement``). ``None``: the world's timeout (also for the subgroups AutoSP
            makes). Not with ``group=``: create your group with its timeout.
        tile_loss: compute a token-wise LM head and its cross entropy in chunks of tokens, so the
            ``[tokens, vocab]`` logits are never whole (``autosp.tile_loss``): True (default) where it
            saves memory, False to leave the graph as is, or an int: the rows of one chunk.
        tile_mlp: compute each token-wise MLP (``act(x W1) W2``, gated or not) in chunks of tokens,
            forward and backward, so its ``[tokens, ffn]`` intermediates are never whole
            (``autosp.tile_mlp``): "auto" (default: tiled with ``sac=True``, which recomputes the
            MLP's first matmuls in the backward anyway; not otherwise, where tiling would add them),
            True, False, or an int: the rows of one chunk.
        memory_budget: bytes (an int) or a fraction (0 < f <= 1) of the device's memory that
            ``sac="auto"`` fits the program into; ``None``: the hardware profile's memory.
        hardware: the profile cost models use (SAC's, ``variant="auto"``'s): a name ("h100-80gb",
            "mi300x", "cpu"), a JSON file from ``autosp-profile``, a ``HardwareProfile``, or ``None``
            to detect the device. The report says which profile was used and where it came from.
        outputs: "whole" (the contract: every output whole on every rank) or "sharded": outputs
            sharded along the sequence come back as DTensors (``Shard`` on the sequence over the SP
            group's mesh), so a large one (an LM's logits) is gathered only when ``.full_tensor()``
            asks for it.
    """

    sp_size: int | None = None
    variant: str = "ulysses"
    sac: bool | Literal["auto"] = "auto"
    group: Any = WeakGroup()
    backend: Backend = "inductor"
    disable_passes: tuple[str, ...] = ()
    grad_bucket_mb: float = 25.0
    variant_options: dict[str, Any] = field(default_factory=dict)
    check_inputs: CheckMode | bool = "tokens"
    timeout: float | timedelta | None = None
    tile_loss: bool | int = True
    tile_mlp: bool | int | Literal["auto"] = "auto"
    memory_budget: int | float | None = None
    hardware: HardwareOption = None
    outputs: Literal["whole", "sharded"] = "whole"
    inductor_config: dict[str, Any] = field(default_factory=dict)  # from mode= / options= (autosp.inductor_options)

    __repr__ = weak_repr

    def __post_init__(self) -> None:
        aliases: dict[object, str] = {False: "off", True: "tokens"}
        check = aliases.get(self.check_inputs, self.check_inputs)
        if check not in CHECK_MODES:
            raise ConfigError(f"check_inputs={self.check_inputs!r}; use 'tokens', 'shapes', 'hash' or 'off' (or False)")
        object.__setattr__(self, "check_inputs", check)
        if self.timeout is not None:
            seconds = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else self.timeout
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ConfigError(f"timeout={self.timeout!r}; give seconds > 0 (or a timedelta), or None")
            if self.group is not None:
                raise ConfigError(
                    "timeout= sets the timeout of the SP group AutoSP creates, and group= was given: a group's "
                    "timeout is fixed when it is made, so create yours with it (dist.new_group(ranks, "
                    "timeout=timedelta(seconds=...))) and leave timeout= unset"
                )
        check_option(self.hardware)
        for name in ("tile_loss", "tile_mlp"):
            value = getattr(self, name)
            if name == "tile_mlp" and value == "auto":
                continue
            if not isinstance(value, int) or (not isinstance(value, bool) and value < 1):
                also = "'auto', " if name == "tile_mlp" else ""
                raise ConfigError(f"{name}={value!r}; use {also}True, False or the rows of one chunk (an int >= 1)")
        budget = self.memory_budget
        if budget is not None and (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or (isinstance(budget, float) and not 0 < budget <= 1)
            or (isinstance(budget, int) and budget < 1)
        ):
            raise ConfigError(
                f"memory_budget={budget!r}; give bytes (an int, e.g. 40 * 2**30) or a fraction of the device's "
                "memory (a float in (0, 1]), or None"
            )
        if self.outputs not in ("whole", "sharded"):
            raise ConfigError(f"outputs={self.outputs!r}; use 'whole' (the default) or 'sharded' (DTensors)")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if self.sac not in (True, False, "auto"):
            raise ConfigError(f"sac={self.sac!r}; use 'auto', True or False")
        if not isinstance(self.grad_bucket_mb, (int, float)) or self.grad_bucket_mb < 0:
            raise ConfigError(f"grad_bucket_mb={self.grad_bucket_mb!r}; it must be a number >= 0 (MiB)")
        if self.sp_size is not None and (not isinstance(self.sp_size, int) or self.sp_size < 1):
            raise ConfigError(f"sp_size={self.sp_size!r}; it must be a positive int or None")

    @property
    def timeout_delta(self) -> timedelta | None:
        if self.timeout is None or isinstance(self.timeout, timedelta):
            return self.timeout
        return timedelta(seconds=self.timeout)


def resolve_group(options: SPOptions) -> tuple[Any, int]:
    """The SP group and its size; raises before any collective when they do not fit."""
    initialized = dist.is_available() and dist.is_initialized()
    if options.sp_size in (None, 1) and not initialized and options.group is None:
        return None, 1
    if not initialized:
        raise ConfigError(
            f"sp_size={options.sp_size} needs an initialized process group: call "
            "torch.distributed.init_process_group() on every rank (or launch with torchrun) before autosp.compile"
        )
    parent = options.group if options.group is not None else dist.group.WORLD
    size = dist.get_world_size(parent)
    sp = options.sp_size or size
    # Before any group is made (by every rank of the parent together) and before any refusal of one rank's own.
    agree(
        dist.get_process_group_ranks(parent),
        options_of(sp, options.group, options.timeout_delta, options.check_inputs),
        group_timeout(parent),
    )
    if sp > size:
        raise ConfigError(f"sp_size={sp} is larger than the process group ({size} ranks); use sp_size <= {size}")
    if size % sp:
        raise ConfigError(
            f"sp_size={sp} does not divide the process group of {size} ranks; "
            f"pick a divisor of {size} so every rank lands in exactly one SP group"
        )
    if sp == size:
        if options.timeout is not None:
            # The world itself is the user's; the SP group is a copy of it with AutoSP's timeout.
            return dist.new_group(timeout=options.timeout_delta), sp
        return parent, sp
    if options.group is not None:
        raise ConfigError(
            f"sp_size={sp} is smaller than the given group ({size} ranks); pass the SP group itself as group="
        )
    # Without timeout=, the subgroups keep the world's timeout: new_subgroups would give them the
    # backend's default instead (30 min for gloo), whatever init_process_group was told.
    timeout = options.timeout_delta or group_timeout(parent)
    group, _ = dist.new_subgroups(group_size=sp, timeout=timeout)
    return group, sp


def compile_sync_group(options: SPOptions, world: int) -> Any:
    """With ``timeout=``: the SP ranks again, with the world's timeout, to wait for each other's compiles.

    A rank that compiles slower (Inductor, a cold cache) must not trip the short timeout of the
    SP group in the first collective of a new graph. ``None`` without ``timeout=`` (the SP group
    then has the world's timeout itself) or without SP.
    """
    if options.timeout is None or world == 1:
        return None
    parent = dist.group.WORLD  # timeout= with group= is refused, so AutoSP made the SP group from the world
    timeout = group_timeout(parent)
    if world == dist.get_world_size(parent):
        return dist.new_group(timeout=timeout)
    group, _ = dist.new_subgroups(group_size=world, timeout=timeout)
    return group


def group_timeout(group: Any) -> timedelta | None:
    """The timeout a process group was made with (``None`` if its backend does not say)."""
    try:
        backends = [group._get_backend(device) for device in group._device_types]
        timeout: timedelta = next(b.options._timeout for b in backends if hasattr(b, "options"))
        return timeout
    except (AttributeError, RuntimeError, StopIteration):
        return None


def timeout_phrase(group: Any) -> str:
    """ "the group's timeout", with its seconds where the group says them, for messages about a wait."""
    timeout = group_timeout(group)
    return f"the group's timeout ({timeout.total_seconds():g} s)" if timeout else "the group's timeout"


__all__ = ["BACKENDS", "Backend", "SPOptions", "compile_sync_group", "group_timeout", "resolve_group", "timeout_phrase"]
