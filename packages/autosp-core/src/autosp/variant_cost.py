"""Estimated attention time of each SP variant, for ``variant="auto"`` and hybrid's default degrees.

Per attention site and training step (forward and backward), per rank:

- compute: 4*B*H*S*S*D/P attention FLOPs forward (half when causal), 2.5x that backward, at the
  profile's attention throughput. Ring and hybrid compute their blocks unfused in fp32
  (``autosp_ring.blocks``): the profile's measured "ring-block/float32" rate, else the fp32 matmul
  rate slowed by the score matrix's memory traffic. Hybrid's ring is contiguous, not zigzag, so
  with a causal mask its last rank does 2R/(R+1) of the average work.
- Ulysses: one all-to-all of q, k and v and one of the output forward, the same backward; no
  overlap with compute. k/v with fewer heads than ranks are repeated to P/gcd(kv, P) as the rule does.
- ring: P-1 hops of k and v forward; backward k/v again plus fp32 dk/dv. Hops overlap the block
  compute, so each direction takes the longer of the two.
- hybrid (U x R): Ulysses' all-to-alls inside groups of U ranks, then a ring of R hops over ranks
  U apart. Heads U does not divide are padded (Ulysses' too): the padding heads cost compute and bytes.

Communication times come from ``HardwareProfile.collective_seconds`` (measured tables when the
profile has them, the interconnect's topology otherwise). The numbers rank candidates; they do not
predict a step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from autosp.analysis.attention import AttentionSite, hint
from autosp.hardware import HardwareProfile
from autosp.sharding.padded import heads_multiple

BACKWARD_FACTOR = 2.5  # flash-style backward: about 2.5x the forward's FLOPs
# HBM bytes per score element of the ring op's unfused fp32 blocks, forward: scores written,
# masked, reduced to the lse, exponentiated and read by the matmul.
RING_BYTES_PER_SCORE = 28


def ring_block_flops(hw: HardwareProfile, head_dim: int) -> float:
    """FLOP/s of the ring op's blocks: measured when the profile has it, else fp32 matmul slowed by score traffic."""
    measured = hw.kernel_flops.get("ring-block/float32")
    if measured:
        return measured
    fp32 = hw.matmul("float32")
    if not hw.memory_bandwidth:
        return fp32
    # Per score element: 4*D FLOPs at the fp32 rate, RING_BYTES_PER_SCORE through memory.
    per_element = 4 * head_dim / fp32 + RING_BYTES_PER_SCORE / hw.memory_bandwidth
    return 4 * head_dim / per_element


@dataclass(frozen=True)
class Estimate:
    """One candidate: the variant, its options, and its estimated cost per step over all sites."""

    variant: str
    options: dict[str, Any] = field(default_factory=dict)
    comm_bytes: float = 0.0
    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def label(self) -> str:
        if not self.options:
            return self.variant
        return f"{self.variant}({', '.join(f'{k}={v}' for k, v in self.options.items())})"

    def describe(self) -> str:
        return (
            f"{self.label}: ~{self.seconds * 1e3:.3g} ms/step (communication {self.comm_bytes / 2**20:.3g} MiB/rank, "
            f"{self.comm_seconds * 1e3:.3g} ms; attention compute {self.compute_seconds * 1e3:.3g} ms)"
        )


@dataclass(frozen=True)
class _Sizes:
    b: int
    h: int
    kv: int
    s: int
    d: int
    elt: int
    causal: bool
    dtype: str

    @staticmethod
    def of(site: AttentionSite) -> _Sizes:
        return _Sizes(
            int(hint(site.batch)),
            int(hint(site.heads)),
            int(hint(site.kv_heads)),
            int(hint(site.seq_len)),
            int(hint(site.head_dim)),
            site.dtype.itemsize,
            bool(site.is_causal),
            str(site.dtype).removeprefix("torch."),
        )

    def flops(self, world: int) -> float:
        """Forward attention FLOPs per rank."""
        f = 4.0 * self.b * self.h * self.s * self.s * self.d / world
        return f / 2 if self.causal else f


def _sum(parts: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))


def ulysses(sites: list[AttentionSite], world: int, hw: HardwareProfile) -> Estimate:
    parts = []
    for site in sites:
        z = _Sizes.of(site)
        # Heads the ranks do not split travel padded to a multiple of them, k/v repeated to the query heads.
        h = heads_multiple(z.h, world)
        if h != z.h:
            kv = h
        else:
            kv = z.kv if z.kv % world == 0 else z.kv * (world // math.gcd(z.kv, world))
        token = z.b * (z.s // world) * z.d * z.elt  # bytes of one head over this rank's tokens
        qkv, out = token * (h + 2 * kv), token * h
        comm = 2 * (hw.collective_seconds("all_to_all", qkv, world) + hw.collective_seconds("all_to_all", out, world))
        compute = (1 + BACKWARD_FACTOR) * z.flops(world) * (h / z.h) / hw.attention(z.dtype)
        parts.append((2 * (qkv + out) * (world - 1) / world, comm, compute))
    nbytes, comm, compute = _sum(parts)
    return Estimate("ulysses", {}, nbytes, comm, compute, comm + compute)


def _ring_part(
    z: _Sizes, kv_heads: float, span: int, ring: int, stride: int, world: int, hw: HardwareProfile, imbalance: float
) -> tuple[float, float, float, float, float]:
    """(bytes, fwd comm s, bwd comm s, fwd compute s, bwd compute s) of the ring over ``ring`` ranks."""
    block = 2 * z.b * kv_heads * span * z.d  # k and v elements of one hop
    fwd_bytes, bwd_bytes = block * z.elt, block * (z.elt + 4)  # backward: k/v and fp32 dk/dv
    hops = ring - 1
    fwd_comm = hops * hw.collective_seconds("p2p", fwd_bytes, ring, stride)
    bwd_comm = (hops + 1) * hw.collective_seconds("p2p", bwd_bytes, ring, stride)
    fwd = imbalance * z.flops(world) / ring_block_flops(hw, z.d)  # unfused fp32 blocks, not SDPA
    return hops * (fwd_bytes + bwd_bytes), fwd_comm, bwd_comm, fwd, BACKWARD_FACTOR * fwd


def ring(sites: list[AttentionSite], world: int, hw: HardwareProfile) -> Estimate:
    parts = []
    for site in sites:
        z = _Sizes.of(site)
        nbytes, fc, bc, fw, bw = _ring_part(z, z.kv, z.s // world, world, 1, world, hw, 1.0)  # zigzag: balanced
        # Hops overlap the blocks: each direction takes the longer of the two.
        parts.append((nbytes, fc + bc, fw + bw, max(fc, fw) + max(bc, bw)))
    nbytes = sum(p[0] for p in parts)
    comm, compute, total = sum(p[1] for p in parts), sum(p[2] for p in parts), sum(p[3] for p in parts)
    return Estimate("ring", {}, nbytes, comm, compute, total)


def hybrid(sites: list[AttentionSite], world: int, hw: HardwareProfile, degree: int) -> Estimate:
    u, r = degree, world // degree
    nbytes = comm = compute = total = 0.0
    for site in sites:
        z = _Sizes.of(site)
        if (h := heads_multiple(z.h, u)) != z.h:  # padded to split over the group, k/v repeated to the query heads
            z = dataclasses.replace(z, h=h, kv=h)
        token = z.b * (z.s // world) * z.d * z.elt
        q_out = 2 * hw.collective_seconds("all_to_all", token * z.h, u) * 2  # q in and out back, fwd and bwd
        if z.kv % u == 0:
            kv_comm = 2 * hw.collective_seconds("all_to_all", 2 * token * z.kv, u)
            kv_local, kv_bytes = z.kv / u, 2 * token * z.kv * (u - 1) / u
        else:  # gathered whole in the group, the heads this rank's queries use kept
            kv_comm = 2 * hw.collective_seconds("all_gather", 2 * token * z.kv, u)
            kv_local, kv_bytes = min(z.kv, z.h / u), 2 * token * z.kv * (u - 1)
        imbalance = 2 * r / (r + 1) if z.causal else 1.0
        rb, fc, bc, fw, bw = _ring_part(z, kv_local, z.s // r, r, u, world, hw, imbalance)
        a2a = q_out + kv_comm
        nbytes += rb + 2 * (2 * token * z.h * (u - 1) / u + kv_bytes)
        comm += a2a + fc + bc
        compute += fw + bw
        total += a2a + max(fc, fw) + max(bc, bw)
    return Estimate("hybrid", {"ulysses_degree": u}, nbytes, comm, compute, total)


def hybrid_degrees(sites: list[AttentionSite], world: int) -> list[int]:
    """Ulysses degrees U with 1 < U < world that divide the world and the head count of every site
    that cannot travel padded (``AttentionSpec.pads_heads``: SDPA's and FlexAttention's heads can)."""
    fixed = [int(hint(s.heads)) for s in sites if not s.spec.pads_heads]
    return [u for u in range(2, world) if world % u == 0 and all(h % u == 0 for h in fixed)]


__all__ = [
    "BACKWARD_FACTOR",
    "RING_BYTES_PER_SCORE",
    "Estimate",
    "hybrid",
    "hybrid_degrees",
    "ring",
    "ring_block_flops",
    "ulysses",
]
