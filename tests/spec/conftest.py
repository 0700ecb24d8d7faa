"""Shared fixtures of the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def parts():
    """(path, cpu backend, model, tokenizer) of the embedded stdlib-coder with its MTP module, fp32, loaded once:
    engines are built around it with DeepInferenceEngine.from_components (nothing here changes the model)."""
    path = deepinfer.embedded_model_path()
    backend = CPUBackend()
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    return path, backend, model, Tokenizer.from_pretrained(path)
