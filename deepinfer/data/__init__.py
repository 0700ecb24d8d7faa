"""Files that ship inside the package: the embedded default model (stdlib-coder, docs/models.md)."""

from __future__ import annotations

import os

EMBEDDED_MODEL_NAME = "stdlib-coder"
EMBEDDED_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json")


def embedded_model_path() -> str:
    """Directory of the embedded model: what `EngineConfig()`, `deepinfer serve` and `deepinfer generate`
    run when no model is given. A plain path (the package is installed as files, never zipped)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), EMBEDDED_MODEL_NAME)
