"""Byte-level tokens and a deterministic batch order.

Batch ``i`` is a pure function of ``(seed, i)``, so a resumed run sees exactly the
batches an uninterrupted run would, and needs no saved data-loader state.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

BOS = 256
EOS = 257
# 256 bytes + BOS/EOS, padded to a multiple of 8 for friendlier matmul shapes.
VOCAB_SIZE = 264
DEFAULT_DATA = "stdlib_docstrings.txt"


def default_data_path() -> Path:
    return Path(str(resources.files("autosp_tools").joinpath("data", DEFAULT_DATA)))


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return bytes(int(i) for i in ids.tolist() if i < 256).decode("utf-8", errors="replace")


def load_tokens(path: str | Path | None) -> torch.Tensor:
    """The whole file as uint8 byte tokens (one byte is one token)."""
    raw = Path(path or default_data_path()).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def batch_at(tokens: torch.Tensor, step: int, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Batch number ``step`` (0-based): ``batch_size`` random windows, each starting with BOS."""
    span = seq_len - 1
    if tokens.numel() <= span:
        raise ValueError(f"the data has {tokens.numel()} bytes; it needs more than seq_len-1={span}")
    # A distinct, reproducible stream per (seed, step); the multiplier keeps nearby seeds apart.
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    starts = torch.randint(0, tokens.numel() - span, (batch_size,), generator=gen)
    rows = [tokens[s : s + span].long() for s in starts.tolist()]
    body = torch.stack(rows)
    return torch.cat([torch.full((batch_size, 1), BOS, dtype=torch.long), body], dim=1)


__all__ = ["BOS", "EOS", "VOCAB_SIZE", "batch_at", "decode", "default_data_path", "encode", "load_tokens"]
