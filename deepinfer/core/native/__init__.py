"""Torch-native ops: the reference implementation of every backend op.

`NativeOps` is the mixin backends inherit; the modules hold one concept each
(norm, rope, activation, kv_write, routing, linear, moe, mla_attention).
"""

from deepinfer.core.native.ops import OP_NAMES, NativeOps
from deepinfer.core.native.rope import mla_softmax_scale, rope_cos_sin_cache

__all__ = ["NativeOps", "OP_NAMES", "mla_softmax_scale", "rope_cos_sin_cache"]
