"""Ring attention sequence parallelism for AutoSP (``variant="ring"``, and ``variant="hybrid"``: Ulysses x ring)."""

from autosp_ring.op import BLOCK_COUNTS, num_steps, ring_attention, ring_attention_backward
from autosp_ring.plugin import HYBRID, RING
from autosp_ring.work import RankWork, imbalance, ring_work

__all__ = [
    "BLOCK_COUNTS",
    "HYBRID",
    "RING",
    "RankWork",
    "imbalance",
    "num_steps",
    "ring_attention",
    "ring_attention_backward",
    "ring_work",
]
