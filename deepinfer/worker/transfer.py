"""Host <-> device copies that never make the host wait for the device's queue.

Why: torch's plain `tensor.to(device)` from pageable host memory synchronizes the stream
(cudaMemcpyAsync + stream sync), and `.tolist()` / `.item()` of a device tensor waits for every
kernel queued before it. With async scheduling the host builds step N+1 while the device still
runs step N, so one such call would stall the host until step N is done and the overlap is lost.
Host data goes up through pinned memory with non_blocking=True (the caching host allocator
keeps the pinned block until the copy has run); results come down into pinned buffers behind
an event that `HostCopy.wait` waits on, so reading them waits for this step only.

On the CPU these are plain tensors: there is no queue to overlap.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without a stream sync (pinned + non_blocking on accelerators)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(data, dtype) placed on `device` without a stream sync."""
    return to_device(torch.tensor(data, dtype=dtype), device)


class HostCopy:
    """Device tensors copied to the host asynchronously; `wait()` returns the host tensors.

    The copies are queued behind the work that produces the tensors, then an event is
    recorded; wait() blocks on that event only, not on work queued after it (the next step).
    """

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        if device.type == "cpu":  # copies all the same: a tensor may be a graph's static buffer, rewritten by the
            self.host = [t.clone() for t in tensors]  # next step before this one is read (spec/pipeline.py overlap)
            self.event = None
            return
        self.host = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self.host.append(h)
        self.event = torch.Event(device=device)
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host
