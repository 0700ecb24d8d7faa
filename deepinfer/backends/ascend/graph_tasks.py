"""Per-replay parameter updates of a captured ACL graph: how a decode graph gets the current step's
sequence lengths, the way vllm-ascend's ACL graph mode does it, on torch_npu's documented API.

npu_fused_infer_attention_score takes actual_seq_lengths_kv as host integers; a capture freezes them.
So while NPUGraphRunner captures a bucket, the MLA op hands its fused-attention call to the open
`TaskRecorder`, which (docs: torch_npu-npu-graph_task_group_begin.md and the _end / update pages):
  - sizes a workspace with `_npu_fused_infer_attention_score_get_max_workspace` and allocates the outputs,
  - `event.wait(stream)`, `event.reset(stream)` on a `torch.npu.ExternalEvent`, so a replay waits for its update,
  - `graph_task_group_begin(stream)`, `npu_fused_infer_attention_score.out(..., workspace=, out=[out, lse])`,
    `handle = graph_task_group_end(stream)`, and keeps (handle, event, the call's arguments).
Before each replay, `update_tasks` re-issues every recorded call on a side stream between
`graph_task_update_begin(stream, handle)` and `graph_task_update_end(stream)` with the step's lengths
(padded rows: 0), then `event.record(stream)`. Written to the docs; never run on an NPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from types import ModuleType

import torch

_RECORDING: contextvars.ContextVar["TaskRecorder | None"] = contextvars.ContextVar("ascend_graph_tasks",
                                                                                  default=None)


@dataclass
class FIATask:
    """One captured npu_fused_infer_attention_score call whose host lengths a replay updates."""

    handle: object
    event: object
    args: tuple
    kwargs: dict  # everything but actual_seq_lengths_kv / workspace / out
    workspace: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


@dataclass
class TaskRecorder:
    npu: ModuleType  # torch_npu
    tasks: list[FIATask] = field(default_factory=list)

    def fused_attention(self, q, k, v, seq_lens_kv: list[int], kwargs: dict) -> torch.Tensor:
        npu, dev = self.npu, self.npu.npu
        stream = dev.current_stream()
        workspace = npu._npu_fused_infer_attention_score_get_max_workspace(
            q, k, v, actual_seq_lengths_kv=seq_lens_kv, **kwargs)
        out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse = torch.empty(1, dtype=q.dtype, device=q.device)  # softmax_lse_flag False: a placeholder
        event = dev.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        dev.graph_task_group_begin(stream)
        npu.npu_fused_infer_attention_score.out(q, k, v, workspace=workspace, out=[out, lse],
                                                actual_seq_lengths_kv=seq_lens_kv, **kwargs)
        handle = dev.graph_task_group_end(stream)
        self.tasks.append(FIATask(handle, event, (q, k, v), dict(kwargs), workspace, out, lse))
        return out


@contextlib.contextmanager
def recording(npu: ModuleType):
    """Open while one bucket is captured: the MLA ops' fused attention calls become updatable tasks."""
    rec = TaskRecorder(npu)
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


def capturing() -> bool:
    """Whether a graph capture is recording (the MLA op then avoids host syncs and unique-index ops)."""
    return _RECORDING.get() is not None


def fused_attention(npu: ModuleType, q, k, v, seq_lens_kv: list[int], **kwargs) -> torch.Tensor:
    """npu_fused_infer_attention_score's attention output; an updatable task while a capture records."""
    rec = _RECORDING.get()
    if rec is not None:
        return rec.fused_attention(q, k, v, seq_lens_kv, kwargs)
    return npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=seq_lens_kv, **kwargs)[0]


def update_tasks(npu: ModuleType, stream, tasks: list[FIATask], seq_lens_kv: list[int]) -> None:
    """Give every captured attention task of a bucket this step's lengths (before the replay)."""
    dev = npu.npu
    with dev.stream(stream):
        for t in tasks:
            dev.graph_task_update_begin(stream, t.handle)
            npu.npu_fused_infer_attention_score.out(*t.args, workspace=t.workspace, out=[t.out, t.lse],
                                                    actual_seq_lengths_kv=seq_lens_kv, **t.kwargs)
            dev.graph_task_update_end(stream)
            t.event.record(stream)
