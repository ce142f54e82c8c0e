"""``AutoSPTrainer``: ``transformers.Trainer`` whose training step is an AutoSP program.

What it changes, and why each piece is needed:

* **Model wrapping** (``_wrap_model``, Trainer's hook for wrappers accelerate does not
  handle): the model is compiled with ``autosp.compile`` over this rank's SP group and,
  with several SP groups, wrapped in DDP over the *dp* group only. AutoSP already gives
  every SP rank the full gradient inside the compiled backward; DDP over the world would
  all-reduce those identical copies again. DDP wraps the compiled program, not the other
  way round as accelerate does, because Dynamo's DDPOptimizer would cut the graph that
  AutoSP needs whole. Returning a wrapped model keeps ``accelerator.prepare`` (and its
  own ``torch.compile``) off the model; the optimizer is still prepared as usual.
* **Data** (``get_train_dataloader``): accelerate shards batches over all processes; the
  shard is re-pointed at the dp replica so the ranks of one SP group read the same rows
  (``autosp_tools.hf.data``).
* **Loss**: nothing to override. Every rank's program returns the exact loss of its SP
  group's batch. With ``average_tokens_across_devices`` (the default) Trainer divides the
  summed token loss by the token count gathered over all ``dp * sp`` processes (each SP
  group's count ``sp`` times) and multiplies the loss by ``dp * sp``; the factors of ``sp``
  cancel, DDP's mean over ``dp`` does the rest, and the logged mean over all processes is
  the global loss. ``integration_tests/test_hf_trainer.py`` checks this against one process.

Evaluation and prediction run the plain model on every rank, each on its own rows, as
Trainer does without AutoSP: sequence parallelism is for the training step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from autosp.options import Backend
from autosp_tools.hf.data import shard_over_dp
from autosp_tools.parallel import Groups, make_groups


@dataclass(frozen=True)
class AutoSPSettings:
    """How ``AutoSPTrainer`` compiles: ``autosp.compile``'s options.

    ``sp_size``: ranks that share each sequence (``None``: all processes, one SP group);
    the other ``world / sp_size`` ways are data parallel. ``backend``: the compiler after
    AutoSP (``None``: ``TrainingArguments.torch_compile_backend`` when ``torch_compile``
    is set, else ``"inductor"``).
    """

    sp_size: int | None = None
    variant: str = "ulysses"
    sac: bool | Literal["auto"] = "auto"
    backend: Backend | None = None
    compile_options: dict[str, Any] = field(default_factory=dict)


class AutoSPTrainer(Trainer):
    """``transformers.Trainer`` training sequence-parallel with AutoSP.

    Takes Trainer's arguments plus ``sp_size``, ``variant``, ``sac``, ``autosp_backend`` and
    ``autosp_options`` (other ``autosp.compile`` keywords). Launch it as any distributed
    Trainer (``torchrun --nproc-per-node 4 train.py``); every process builds the same model
    and dataset. ``per_device_train_batch_size`` is the batch of one SP group, so the global
    batch is ``per_device_train_batch_size * gradient_accumulation_steps * world / sp_size``.
    """

    def __init__(
        self,
        *args: Any,
        sp_size: int | None = None,
        variant: str = "ulysses",
        sac: bool | Literal["auto"] = "auto",
        autosp_backend: Backend | None = None,
        autosp_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if sp_size is not None and sp_size < 1:
            raise ValueError(f"sp_size must be a positive number of ranks, got {sp_size}")
        self.autosp = AutoSPSettings(
            sp_size=sp_size,
            variant=variant,
            sac=sac,
            backend=autosp_backend,
            compile_options=dict(autosp_options or {}),
        )
        self._autosp_groups: Groups | None = None
        self._autosp_program: Any = None
        super().__init__(*args, **kwargs)
        self._check_mesh()

    # ---- the mesh -----------------------------------------------------------------------

    @property
    def sp_size(self) -> int:
        return self.autosp.sp_size or self.args.world_size

    @property
    def dp_size(self) -> int:
        return self.args.world_size // self.sp_size

    def _check_mesh(self) -> None:
        world = self.args.world_size
        if world % self.sp_size:
            raise ValueError(
                f"sp_size={self.sp_size} does not divide the {world} processes; launch a multiple of sp_size "
                "processes (the rest of the factor is data parallel)"
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"AutoSPTrainer runs one process per device, and this process sees {self.args.n_gpu} GPUs "
                "(Trainer would use nn.DataParallel); launch with torchrun, one process per GPU"
            )

    @property
    def autosp_groups(self) -> Groups:
        """This rank's SP and dp process groups (made on first use: every rank must get here)."""
        if self._autosp_groups is None:
            self._autosp_groups = make_groups(self.dp_size, self.sp_size, self.args.world_size)
        return self._autosp_groups

    # ---- data ---------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        groups = self.autosp_groups
        return shard_over_dp(loader, groups.dp_rank, groups.dp_size)

    # ---- the model ----------------------------------------------------------------------

    def _autosp_inner_backend(self) -> Backend:
        if self.autosp.backend is not None:
            return self.autosp.backend
        if not (self.args.torch_compile and self.args.torch_compile_backend):
            return "inductor"
        name = self.args.torch_compile_backend
        if name not in get_args(Backend):
            raise ValueError(
                f"torch_compile_backend={name!r}: AutoSP compiles the training step and hands the result to "
                f"one of {', '.join(get_args(Backend))}; set torch_compile_backend to one of them, or pass "
                "autosp_backend= to AutoSPTrainer"
            )
        return cast(Backend, name)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training=False, dataloader=dataloader)
        if self._autosp_program is not None:
            return self._autosp_program
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            raise ValueError(
                "AutoSPTrainer got a model that is already wrapped or compiled; pass the plain model: "
                "AutoSPTrainer compiles it with AutoSP and wraps it for data parallelism itself"
            )
        self._autosp_program = self._build_program(model)
        return self._autosp_program

    def _build_program(self, model: nn.Module) -> nn.Module:
        import autosp

        groups = self.autosp_groups
        world = self.args.world_size
        if world > 1:
            # The contract is identical parameters on every rank; one broadcast makes an unseeded init safe.
            with torch.no_grad():
                for t in model.state_dict().values():
                    dist.broadcast(t, src=0)
        sp_kwargs: dict[str, Any] = {"sp_size": self.sp_size, "group": groups.sp} if world > 1 else {}
        # A module compiles to its OptimizedModule (forward routed through AutoSP's guarded call).
        program = cast(
            nn.Module,
            autosp.compile(
                model,
                variant=self.autosp.variant,
                sac=self.autosp.sac,
                backend=self._autosp_inner_backend(),
                **sp_kwargs,
                **self.autosp.compile_options,
            ),
        )
        if groups.dp_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            program = DDP(program, process_group=groups.dp)
        return program


__all__ = ["AutoSPSettings", "AutoSPTrainer"]
