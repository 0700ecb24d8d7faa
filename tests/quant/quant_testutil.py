"""Helpers of the quantization tests: teacher-forced logits of a model over one prompt (no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from paged_batch_util import PagedKV  # noqa: E402


def prefill_logits(model, backend, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, V] for every position of the one sequence `ids` [1, T]."""
    kv = PagedKV(model)
    return kv.step([(0, ids[0].tolist())]).float()
