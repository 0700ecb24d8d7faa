"""DeepInfer: an inference engine for DeepSeek models.

    from deepinfer import DeepInferenceEngine, EngineConfig
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.data import embedded_model_path
    from deepinfer.engine import LLM, DeepInferenceEngine

_LAZY = {
    "EngineConfig": "deepinfer.config",
    "DeepInferenceEngine": "deepinfer.engine",
    "LLM": "deepinfer.engine",
    "embedded_model_path": "deepinfer.data",
}

__all__ = [
    "CompletionOutput",
    "DeepInferenceEngine",
    "EngineConfig",
    "LLM",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "embedded_model_path",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
