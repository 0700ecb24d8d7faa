"""worker/step_timer.py on the CPU: it refuses a device without stream events (the GPU behaviour is
tested in test_engine_async_scheduling_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import DeepInferError
from deepinfer.worker.step_timer import StepTimer


def test_step_timer_refuses_the_cpu():
    with pytest.raises(DeepInferError, match="accelerator"):
        StepTimer(torch.device("cpu"))

