"""`LinearQuantSettings`: what a model load does with its linears beyond the checkpoint's own format.

Two choices the checkpoint cannot make for the engine:
- fp8_activations: fp8 block weights run W8A8 ("fp8_w8a8": activations quantized per token per 128
  channels) instead of W8A16 ("fp8_block", the default, what fp8 checkpoints ran before);
- online: "fp8" quantizes every dense (bf16 / fp16 / fp32) `Linear` at load into 128x128 e4m3 blocks
  and runs it W8A8. The LM head, embeddings, norms and the router gate are not `Linear`s and stay.
- fuse_act_quant: whether the op before a W8A8 linear (a decoder layer's RMSNorm, an MLP's SiLU-and-mul) writes
  the linear's e4m3 input in its own pass (backend/fp8_act.py); None: DEEPINFER_FP8_EPILOGUE_QUANT decides. The
  config file's `fuse_quant_dequant` sets it (quant_config.py); the layers read it when they are built
  (`fused_act_quant`).

A load runs under one settings object, entered with `use_linear_quant(...)` around `load_model`
(a context variable, like the `torch.device` context load_model already sets): `Linear.finalize`
reads it when it picks its scheme. Outside any context the defaults apply (the checkpoint as stored).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

from deepinfer.errors import ConfigError

ONLINE_METHODS = ("fp8",)


@dataclass(frozen=True)
class LinearQuantSettings:
    fp8_activations: bool = False
    online: str | None = None
    fuse_act_quant: bool | None = None

    def __post_init__(self) -> None:
        if self.online is not None and self.online not in ONLINE_METHODS:
            raise ConfigError(f"online quantization {self.online!r} is not supported (supported: fp8)")

    def fp8_scheme(self) -> str:
        """The linear scheme fp8 block weights run as."""
        return "fp8_w8a8" if self.fp8_activations or self.online == "fp8" else "fp8_block"


_ACTIVE: contextvars.ContextVar[LinearQuantSettings] = contextvars.ContextVar(
    "deepinfer_linear_quant", default=LinearQuantSettings())


def active_linear_quant() -> LinearQuantSettings:
    return _ACTIVE.get()


def fused_act_quant() -> bool:
    """Whether a layer built now has the op before its fp8 W8A8 linears write their quantized input: the load's
    settings where they say (the config file's fuse_quant_dequant, which wins as an explicit setting does), else
    DEEPINFER_FP8_EPILOGUE_QUANT."""
    chosen = _ACTIVE.get().fuse_act_quant
    if chosen is not None:
        return chosen
    from deepinfer import envs

    return envs.FP8_EPILOGUE_QUANT.get()


@contextlib.contextmanager
def use_linear_quant(settings: LinearQuantSettings) -> Iterator[LinearQuantSettings]:
    token = _ACTIVE.set(settings)
    try:
        yield settings
    finally:
        _ACTIVE.reset(token)
