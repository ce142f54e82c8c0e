"""What the per-call weight check's fingerprints cost: ``StateDigest(model).fingerprints()`` on HF
Llama models of growing size, one process, best of 7.

    python tools/scripts/digest_cost.py [--sizes 4x256,16x1024,32x2048]

Every call reads every parameter's and buffer's sample afresh (``autosp.sample_digest``): a write
through ``.data`` moves no version counter, so nothing can be taken for unchanged.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autosp.param_check import StateDigest


def best_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x256,16x1024,32x2048", help="layers x hidden size, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| layers | hidden | tensors | parameters | fingerprints ms |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        layers, hidden = (int(v) for v in size.split("x"))
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=32000,
        )
        model = LlamaForCausalLM(config)
        digest = StateDigest(model)
        params = list(model.parameters())
        ms = best_ms(digest.fingerprints)
        print(f"| {layers} | {hidden} | {len(params)} | {sum(p.numel() for p in params) / 1e9:.2f}B | {ms:.1f} |")


if __name__ == "__main__":
    main()
