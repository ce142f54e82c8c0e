"""Workers for the SAC tests (module level: spawned ranks import them by name)."""

from __future__ import annotations

import torch
import torch.nn as nn

import autosp
from autosp.testing import Config, LlamaLike, SavedBytes


class DropoutLlama(LlamaLike):
    """LlamaLike with dropout on the embeddings: random ops inside the compiled graph."""

    def __init__(self, c: Config) -> None:
        super().__init__(c)
        self.drop = nn.Dropout(0.2)
        embed = self.embed
        self.embed = nn.Sequential(embed, self.drop)


def build(dropout: bool) -> nn.Module:
    torch.manual_seed(0)
    c = Config(layers=2)
    return DropoutLlama(c) if dropout else LlamaLike(c)


def run(rank: int, world: int, seq: int, sacs: list, dropout: bool) -> dict:
    """Loss, gradients and SAC report per setting; the same seed before each step."""
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(3))
    out = {}
    for sac in sacs:
        torch._dynamo.reset()  # every setting compiles the same code; stay under Dynamo's recompile limit
        model = build(dropout)
        compiled = autosp.compile(model, sac=sac, backend="aot_eager", sp_size=world if world > 1 else None)
        torch.manual_seed(1234)  # every rank alike: ranks seeded apart are refused when the graph draws
        loss = compiled(ids, ids)
        loss.backward()
        out[str(sac)] = {
            "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "sac": dict(compiled.autosp_reports[0].sac),
        }
    return out


def saved_bytes(seq: int, sac, backend: str = "aot_eager", **options) -> tuple[int, dict]:
    """Bytes saved for backward by one compiled forward (parameters excluded), one process.

    Inductor's on-disk caches are off here: a hit would skip the passes, and with them the report.
    """
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    caches_off = contextlib.ExitStack()
    if backend == "inductor":
        caches_off.enter_context(inductor_config.patch(fx_graph_cache=False))
        caches_off.enter_context(functorch_config.patch(enable_autograd_cache=False))
    with caches_off:
        return _saved_bytes(seq, sac, backend, **options)


def _saved_bytes(seq: int, sac, backend: str, **options) -> tuple[int, dict]:
    torch._dynamo.reset()
    model = build(False)
    compiled = autosp.compile(model, sac=sac, backend=backend, **options)
    ids = torch.randint(0, 96, (1, seq), generator=torch.Generator().manual_seed(0))
    compiled(ids, ids).backward()
    saved = SavedBytes(model.parameters(), distinct=False)
    with saved.record():
        loss = compiled(ids, ids)
    loss.backward()
    return saved.total, dict(compiled.autosp_reports[0].sac)
