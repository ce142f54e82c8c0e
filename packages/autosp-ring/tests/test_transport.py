"""Which ring transfers go through host memory (no processes: the CUDA path needs a GPU machine)."""

import pytest
import torch

from autosp_ring.op import host_staged


@pytest.mark.parametrize(
    "backend, device, staged",
    [
        ("gloo", "cpu", False),
        ("gloo", "cuda", True),  # gloo's send/recv take host pointers only
        ("nccl", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cuda", False),
        ("cpu:gloo,cuda:gloo", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cpu", False),
        ("gloo", "xpu", True),
        ("xccl", "xpu", False),
    ],
)
def test_host_staged(backend, device, staged):
    assert host_staged(backend, torch.device(device)) is staged
