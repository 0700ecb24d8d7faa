"""The fp8 KV cache's per-layer scale as checkpoints store it, for the MLA latent cache.

Why: fp8 checkpoints made by llm-compressor / ModelOpt and read by vLLM carry a calibrated scale per attention layer
(`self_attn.k_scale`, older `kv_scale`, `self_attn.attn.k_scale`; stored = x / scale in e4m3). Before this
module DeepseekV2ForCausalLM.load_weights refused such a checkpoint (an unexpected tensor); DeepSeek's own
releases have none, and their fp8 cache runs at 1.0 (docs/quantization.md "fp8 KV cache").

MLA caches one latent per token (keys and values are both read from it), so a layer has one scale: the key scale
under any of its names (names that disagree are an error), and a value scale is accepted only where it equals the
key scale (1.0 when the checkpoint gives none), as vLLM's MLA cache writes with the key scale only. Every scale is
a positive finite scalar. The op keeps it whatever the cache dtype; only an fp8 cache reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch

from deepinfer.errors import ModelLoadError
from deepinfer.models.weights import Loader

KEY_SCALE_NAMES = ("k_scale", "kv_scale", "attn.k_scale")  # the latent's scale (vLLM's names for it)
VALUE_SCALE_NAMES = ("v_scale", "attn.v_scale")


@dataclass
class KVScaleTensors:
    """The scale tensors one attention layer's checkpoint prefix (`model.layers.{i}.self_attn`) may carry."""

    prefix: str
    given: dict[str, float] = field(default_factory=dict)

    def loaders(self) -> dict[str, Loader]:
        return {f"{self.prefix}.{name}": partial(self._take, name) for name in KEY_SCALE_NAMES + VALUE_SCALE_NAMES}

    def _take(self, name: str, t: torch.Tensor) -> None:
        full = f"{self.prefix}.{name}"
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ModelLoadError(f"{full}: a KV-cache scale is one floating-point number, got {shape}")
        value = float(t.reshape(()).to(torch.float32))
        if not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{full}: a KV-cache scale must be positive and finite, got {value}")
        self.given[name] = value

    def resolve(self) -> float | None:
        """The layer's latent-cache scale (None: the checkpoint gives none); an error where its tensors disagree."""
        keys = {n: v for n, v in self.given.items() if n in KEY_SCALE_NAMES}
        if len(set(keys.values())) > 1:
            listed = ", ".join(f"{self.prefix}.{n} = {v}" for n, v in sorted(keys.items()))
            raise ModelLoadError(f"the layer's KV-cache scales disagree ({listed}): MLA caches one latent with one "
                                 f"scale")
        scale = next(iter(keys.values()), None)
        for name in VALUE_SCALE_NAMES:
            if name in self.given and self.given[name] != (1.0 if scale is None else scale):
                raise ModelLoadError(
                    f"{self.prefix}.{name} = {self.given[name]} differs from the key scale "
                    f"({'none given: 1.0' if scale is None else scale}): MLA caches one latent per token, read as "
                    f"both keys and values, with one scale (the key scale), so a different value scale cannot be "
                    f"honoured")
        return scale
