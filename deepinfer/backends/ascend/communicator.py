"""Collectives over torch.distributed's `hccl` backend (torch_npu registers it), with the contract's
semantics (backend/communicator.py).

HCCL takes the same torch.distributed calls as NCCL (all_to_all_single with split sizes, reduce_scatter,
all_gather, broadcast, all_reduce on bf16 / fp16), so the contract's TorchDistributedCommunicator does the
work; this class only insists that the group really runs on HCCL (NPU tensors through a gloo group fail deep
inside torch_npu otherwise). Over the CPU fake of torch_npu the tests run it on a gloo group
(`transport="gloo"`). Never run across NPUs (docs/ascend.md).
"""

from __future__ import annotations

from deepinfer.backend import TorchDistributedCommunicator


class HCCLCommunicator(TorchDistributedCommunicator):
    def __init__(self, group=None, name: str = "", *, transport: str = "hccl"):
        super().__init__(group, name, expect_transport=transport, reduce_scatter="native")
