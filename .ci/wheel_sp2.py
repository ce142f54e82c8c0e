"""A tiny sp=2 program against the installed wheels: loss and every gradient equal single-device eager.

Run by .ci/wheels.sh in a venv holding only torch, pluggy, autosp-core and autosp-ulysses, so it
imports nothing from this repository (no test helpers): what a user who ran
``pip install autosp-core autosp-ulysses`` has.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
BATCH, SEQ, DIM, HEADS, VOCAB = 2, 16, 16, 2, 32


class TinyLM(nn.Module):
    """Embedding, one causal SDPA layer, a head and a token-mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # [B, S, D]
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)  # [B, H, S, Dh] each
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(BATCH, SEQ, DIM)
        logits = self.head(x + self.proj(attn))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _rank(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        import autosp

        torch.manual_seed(0)  # same model and inputs on every rank, as the contract asks
        model = TinyLM()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        labels = ids.roll(-1, 1)
        labels[0, :5] = -100  # ignored tokens, all in rank 0's half

        ref = copy.deepcopy(model)
        ref_loss = ref(ids, labels)
        ref_loss.backward()

        compiled = autosp.compile(model, sp_size=WORLD, backend="aot_eager")
        loss = compiled(ids, labels)
        loss.backward()

        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} loss: {m}")
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, f"rank {rank}: {name} has no gradient"
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
        report = compiled.autosp_reports[0]
        assert report.collectives.get("all_to_all", 0) >= 2, f"rank {rank}: no Ulysses all-to-all: {report}"
        print(
            f"rank {rank}: loss {loss.item():.6f} (eager {ref_loss.item():.6f}), grads match, "
            f"autosp {autosp.__version__} from {os.path.dirname(autosp.__file__)}",
            flush=True,
        )
    finally:
        dist.destroy_process_group()
    # Importing torch._dynamo keeps the default group's Python object alive past
    # destroy_process_group (torch 2.13), so gloo is torn down again during interpreter
    # finalization, where it aborts ("terminate called without an active exception") in rare runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"),), nprocs=WORLD, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
