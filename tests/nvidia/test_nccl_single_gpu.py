"""NCCL on the one lent GPU: the collectives the communicator uses, run through NCCL at world size 1.

Issue 20 asks for single-GPU NCCL self-tests before any multi-GPU kind is lent. One process cannot hold two
NCCL ranks on one GPU (NCCL refuses a duplicate device), so this checks what one rank can: the process group
comes up on "nccl", every torch.distributed call `TorchDistributedCommunicator` makes (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single with split sizes, broadcast) runs as a NCCL
kernel on CUDA tensors in bf16 and fp32 and returns the world-1 result, and the communicator accepts the group
with expect_transport="nccl". It proves the NCCL library and torch's binding work on this image, not that
several ranks agree (issue 20's multi-GPU runs).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_one_collectives(tmp_path):
    import torch.distributed as dist

    from deepinfer.backend import TorchDistributedCommunicator

    assert dist.is_nccl_available()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        assert dist.get_backend() == "nccl"
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.arange(24, device="cuda", dtype=torch.float32).view(6, 4).to(dtype)
            y = x.clone()
            dist.all_reduce(y)
            torch.testing.assert_close(y, x, rtol=0, atol=0)
            g = torch.empty_like(x)
            dist.all_gather_into_tensor(g, x)
            torch.testing.assert_close(g, x, rtol=0, atol=0)
            rs = torch.empty_like(x)
            dist.reduce_scatter_tensor(rs, x)
            torch.testing.assert_close(rs, x, rtol=0, atol=0)
            a2a = torch.empty_like(x)
            dist.all_to_all_single(a2a, x, [6], [6])
            torch.testing.assert_close(a2a, x, rtol=0, atol=0)
            b = x.clone()
            dist.broadcast(b, src=0)
            torch.testing.assert_close(b, x, rtol=0, atol=0)
        torch.cuda.synchronize()
        comm = TorchDistributedCommunicator(None, "tp", expect_transport="nccl")
        assert comm.world_size == 1 and comm.transport == "nccl"
        z = torch.randn(3, 5, device="cuda")
        assert torch.equal(comm.all_reduce(z), z)
        assert torch.equal(comm.all_to_all(z, [3], [3]), z)
    finally:
        dist.destroy_process_group()
