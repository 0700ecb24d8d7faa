"""The engine room: `DeepInferenceEngine` (alias `LLM`), the public Python API.

`llm_engine.py` (the class: start-up, the streaming API add_request / step / abort, and the
offline generate / chat), `startup.py` (start-up decisions: dtype, backend check, KV budget,
checkpoint facts), `stats.py` (EngineStats, what /metrics reads).
"""

from deepinfer.engine.llm_engine import LLM, DeepInferenceEngine
from deepinfer.engine.stats import EngineStats

__all__ = ["DeepInferenceEngine", "EngineStats", "LLM"]
