"""Hardware profiles: what cost models know about a device and the links of its SP group.

A profile holds per-dtype dense matmul throughput, HBM size and bandwidth, the intra-node
interconnect (bandwidth and topology), optional measured collective times (from
``autosp-profile``) and facts about the attention kernels that change the rewrite.
Built-in profiles live in ``autosp.hardware_builtin`` (NVIDIA, CPU) and in plugins
(``autosp-rocm``: AMD Instinct); JSON profiles load with ``load_profile``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

CollectiveKind = Literal["all_to_all", "all_gather", "p2p"]
COLLECTIVES: tuple[CollectiveKind, ...] = ("all_to_all", "all_gather", "p2p")
Topology = Literal["switch", "mesh", "uneven", "host"]

# Per-collective launch latency when nothing was measured. Not a vendor figure: the order of a
# small NCCL/RCCL collective inside one node (tens of microseconds). autosp-profile replaces it.
DEFAULT_LATENCY = 20e-6


@dataclass(frozen=True)
class Interconnect:
    """The links between the devices of one node, per direction.

    Attributes:
        name: what the link is ("NVLink 4 via NVSwitch", "Infinity Fabric").
        bandwidth: bytes/s one device can send to all its peers together.
        topology: "switch" (any pair at full ``bandwidth``), "mesh" (one direct link of
            ``link_bandwidth`` to each peer), "uneven" (``peer_bandwidth`` per pair),
            "host" (processes of one machine through memory).
        devices: devices per node in this topology.
        link_bandwidth: per-direction bytes/s of one direct link ("mesh").
        peer_bandwidth: per-direction bytes/s between local devices i and j ("uneven"; 0 = no
            direct link).
        latency: seconds per collective launch.
    """

    name: str
    bandwidth: float
    topology: Topology = "switch"
    devices: int = 8
    link_bandwidth: float = 0.0
    peer_bandwidth: tuple[tuple[float, ...], ...] = ()
    latency: float = DEFAULT_LATENCY

    def pair(self, i: int, j: int) -> float:
        """Per-direction bytes/s from local device i to j."""
        if self.topology == "uneven" and self.peer_bandwidth:
            n = len(self.peer_bandwidth)
            return self.peer_bandwidth[i % n][j % n]
        if self.topology == "mesh":
            return self.link_bandwidth
        return self.bandwidth

    def all_to_all_bandwidth(self, world: int) -> float:
        """Bytes/s of the data one rank sends to its peers in an all-to-all over local devices 0..world-1.

        A mesh drives one link per peer at once; on uneven links the slowest pair finishes last,
        so the rank's effective rate is (world-1) times its slowest link.
        """
        if world <= 1:
            return math.inf
        if self.topology in ("mesh", "uneven"):
            slowest = min(self.pair(i, j) for i in range(world) for j in range(world) if i != j)
            # A pair without a direct link goes through another device: half that device's rate.
            slowest = slowest or min(x for row in self.peer_bandwidth for x in row if x) / 2
            return min(self.bandwidth, slowest * (world - 1))
        return self.bandwidth

    def ring_bandwidth(self, world: int, stride: int = 1) -> float:
        """Bytes/s of one hop of a ring over local devices 0, stride, 2*stride, ...: the slowest link."""
        if world <= 1:
            return math.inf
        hops = [self.pair(i * stride, (i + 1) % world * stride) for i in range(world)]
        slowest = min(hops)
        if not slowest:
            slowest = min(x for row in self.peer_bandwidth for x in row if x) / 2
        return min(self.bandwidth, slowest)


@dataclass(frozen=True)
class CommModel:
    """Measured time of one collective against the bytes each rank puts in.

    ``points`` are (bytes per rank, seconds) at group size ``world``; times between points are
    interpolated, beyond them extended at the fitted ``bandwidth``. Without points the model is
    ``latency + volume / bandwidth``.
    """

    latency: float
    bandwidth: float
    points: tuple[tuple[float, float], ...] = ()
    world: int = 2

    def seconds(self, nbytes: float, world: int, kind: CollectiveKind) -> float:
        vol = volume(kind, nbytes, world)
        if not self.points:
            return steps(kind, world) * self.latency + vol / self.bandwidth
        # The table is in the volume moved at its own group size, so it carries over to others.
        xs = [volume(kind, b, self.world) for b, _ in self.points]
        ys = [t for _, t in self.points]
        if vol <= xs[0]:
            return ys[0]
        if vol >= xs[-1]:
            return ys[-1] + (vol - xs[-1]) / self.bandwidth
        i = bisect.bisect_left(xs, vol)
        w = (vol - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 0.0
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    @staticmethod
    def fit(points: list[tuple[float, float]], world: int, kind: CollectiveKind) -> CommModel:
        """Least-squares latency and bandwidth through measured (bytes per rank, seconds) points."""
        pts = sorted(points)
        xs = [volume(kind, b, world) for b, _ in pts]
        ys = [t for _, t in pts]
        n = len(pts)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        if slope <= 0:  # flat or noisy: the largest message alone
            slope = ys[-1] / xs[-1] if xs[-1] else 1e-12
        latency = max(0.0, (my - slope * mx) / steps(kind, world))
        return CommModel(latency, 1.0 / slope, tuple(pts), world)


def volume(kind: CollectiveKind, nbytes: float, world: int) -> float:
    """Bytes one rank sends in ``kind`` when each rank's input has ``nbytes``."""
    if kind == "all_to_all":
        return nbytes * (world - 1) / world
    if kind == "all_gather":
        return nbytes * (world - 1)  # ring all-gather: P-1 hops of one shard
    return nbytes


def steps(kind: CollectiveKind, world: int) -> int:
    return max(1, world - 1) if kind == "all_gather" else 1


@dataclass(frozen=True)
class AttentionKernel:
    """What one fused attention kernel accepts and returns (facts that change the rewrite).

    Attributes:
        name: "flash", "efficient" (memory-efficient), "cudnn", "cpu-flash".
        gqa: accepts k/v with fewer heads than q (SDPA ``enable_gqa``) without repeating them.
        max_head_dim: largest head dimension it runs (0: no limit known).
        dtypes: dtypes it runs ("float16", "bfloat16", "float32").
        lse_base: the base of the log-sum-exp it returns (e, or 2 for AOTriton before 0.11).
        note: where the fact comes from.
    """

    name: str
    gqa: bool = True
    max_head_dim: int = 0
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    lse_base: float = math.e
    note: str = ""

    def accepts(self, head_dim: int, dtype: str, gqa: bool) -> bool:
        return (
            (self.gqa or not gqa) and (not self.max_head_dim or head_dim <= self.max_head_dim) and dtype in self.dtypes
        )


@dataclass(frozen=True)
class HardwareProfile:
    """What cost models know about one device kind and its node.

    The first five fields are the original (name, device_type, flops, comm_bandwidth, match)
    so older code keeps working: ``flops`` is the dense matmul FLOP/s at ``default_dtype`` and
    ``comm_bandwidth`` the all-to-all bytes/s; either is filled from the other form when absent.

    Attributes:
        name: profile name ("h100-80gb", "mi300x", "cpu", or a measured profile's name).
        device_type: torch device type ("cuda" also on ROCm builds, "cpu").
        flops: dense matmul FLOP/s at ``default_dtype``.
        comm_bandwidth: bytes/s a rank sends in an all-to-all of the SP group.
        match: substrings of the device name that select this profile.
        vendor: "nvidia", "amd", "cpu", ...
        arch: GPU architecture ("sm_90", "gfx942"); ROCm detection matches ``gcnArchName`` on it.
        matmul_flops: dense FLOP/s per dtype name ("float32", "tf32", "bfloat16", "float16", "float8").
        attention_flops: fused SDPA FLOP/s per dtype, forward and backward (3.5x the forward's
            FLOPs over their time; measured by ``autosp-profile``); else the matmul figure.
        kernel_flops: throughput of named kernels other than SDPA, e.g. "ring-block/float32" (the
            ring op's blocks, forward and backward, 3.5x the forward FLOPs counted).
        memory_bytes: HBM (device memory) bytes of one device.
        memory_bandwidth: HBM bytes/s.
        interconnect: the node's links.
        comm: measured collective models by kind ("all_to_all", "all_gather", "p2p").
        attention_kernels: fused attention kernels in order of preference.
        default_dtype: the dtype ``flops`` refers to.
        source: where the numbers come from (data sheet, measurement).
    """

    name: str
    device_type: str
    flops: float = 0.0
    comm_bandwidth: float = 0.0
    match: str | tuple[str, ...] = ()
    vendor: str = field(default="", kw_only=True)
    arch: str = field(default="", kw_only=True)
    matmul_flops: Mapping[str, float] = field(default_factory=dict, kw_only=True)
    attention_flops: Mapping[str, float] = field(default_factory=dict, kw_only=True)
    kernel_flops: Mapping[str, float] = field(default_factory=dict, kw_only=True)
    memory_bytes: int = field(default=0, kw_only=True)
    memory_bandwidth: float = field(default=0.0, kw_only=True)
    interconnect: Interconnect | None = field(default=None, kw_only=True)
    comm: Mapping[str, CommModel] = field(default_factory=dict, kw_only=True)
    attention_kernels: tuple[AttentionKernel, ...] = field(default=(), kw_only=True)
    default_dtype: str = field(default="bfloat16", kw_only=True)
    source: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        matmul = dict(self.matmul_flops)
        if not self.flops and not matmul:
            raise ValueError(f"hardware profile {self.name!r}: give flops= or matmul_flops=")
        if self.flops and self.default_dtype not in matmul:
            matmul[self.default_dtype] = float(self.flops)
        object.__setattr__(self, "matmul_flops", matmul)
        if not self.flops:
            object.__setattr__(self, "flops", self.matmul(self.default_dtype))
        measured = self.comm.get("all_to_all")
        if self.interconnect is None:
            any_measured = measured or next(iter(self.comm.values()), None)
            bandwidth = self.comm_bandwidth or (any_measured.bandwidth if any_measured else 0.0)
            if not bandwidth:
                raise ValueError(f"hardware profile {self.name!r}: give comm_bandwidth=, interconnect= or comm=")
            object.__setattr__(self, "interconnect", Interconnect("unspecified", float(bandwidth)))
        if not self.comm_bandwidth:
            bandwidth = measured.bandwidth if measured else self.interconnect.all_to_all_bandwidth(2)
            object.__setattr__(self, "comm_bandwidth", bandwidth)
        if isinstance(self.match, str):
            object.__setattr__(self, "match", (self.match,) if self.match else ())

    def matmul(self, dtype: torch.dtype | str) -> float:
        """Dense matmul FLOP/s at ``dtype`` (float32 uses TF32's figure only when given as "tf32")."""
        key = dtype_name(dtype)
        if key in self.matmul_flops:
            return self.matmul_flops[key]
        if key in ("float16", "bfloat16"):
            other = "bfloat16" if key == "float16" else "float16"
            if other in self.matmul_flops:
                return self.matmul_flops[other]
        return self.matmul_flops.get(self.default_dtype) or max(self.matmul_flops.values())

    def attention(self, dtype: torch.dtype | str) -> float:
        """Attention FLOP/s at ``dtype``: measured when ``autosp-profile`` wrote it, else the matmul figure."""
        key = dtype_name(dtype)
        return self.attention_flops.get(key) or self.matmul(dtype)

    def collective_seconds(self, kind: CollectiveKind, nbytes: float, world: int, stride: int = 1) -> float:
        """Seconds of one ``kind`` collective over ``world`` ranks with ``nbytes`` per rank's input.

        ``stride``: the group's ranks are every stride-th local device (the ring groups of hybrid).
        """
        if world <= 1 or nbytes <= 0:
            return 0.0
        model = self.comm.get(kind)
        if model is not None:
            return model.seconds(nbytes, world, kind)
        link = self.interconnect
        assert link is not None
        bw = link.all_to_all_bandwidth(world) if kind == "all_to_all" else link.ring_bandwidth(world, stride)
        return steps(kind, world) * link.latency + volume(kind, nbytes, world) / bw

    def kernel_for(self, head_dim: int, dtype: torch.dtype | str, gqa: bool) -> AttentionKernel | None:
        """The first preferred attention kernel that runs this call, or None (math fallback)."""
        key = dtype_name(dtype)
        return next((k for k in self.attention_kernels if k.accepts(head_dim, key, gqa)), None)


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8"}.get(dtype, dtype)


def select_profile(device: torch.device, profiles: tuple[HardwareProfile, ...]) -> HardwareProfile:
    """The most specific profile for ``device``: a device-name match first, then the device type's generic one.

    ROCm builds report device type "cuda"; plugins that know better (autosp-rocm) answer the
    ``autosp_select_hardware`` hook before this is called.
    """
    candidates = [p for p in profiles if p.device_type == device.type]
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        named = [p for p in candidates if any(m in name for m in p.match)]
        if named:
            return max(named, key=lambda p: max(len(m) for m in p.match if m in name))
    generic = [p for p in candidates if not p.match]
    if generic:
        return generic[-1]
    from autosp.hardware_builtin import CPU

    return CPU


def builtin_profile(name: str) -> HardwareProfile:
    """A profile by name: core's built-ins and those registered by installed plugins (autosp-rocm)."""
    from autosp.hardware_io import find_named

    return find_named(name)


def load_profile(path_or_name: str | Any) -> HardwareProfile:
    """A profile from a JSON file (``autosp-profile`` writes one) or a built-in / registered name."""
    from autosp.hardware_io import load

    return load(path_or_name)


from autosp.hardware_builtin import BUILTIN_PROFILES  # noqa: E402 - the table needs the classes above

__all__ = [
    "BUILTIN_PROFILES",
    "COLLECTIVES",
    "AttentionKernel",
    "CommModel",
    "HardwareProfile",
    "Interconnect",
    "builtin_profile",
    "dtype_name",
    "load_profile",
    "select_profile",
    "volume",
]
