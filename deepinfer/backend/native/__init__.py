"""Torch-native ops: the reference implementation of every backend op.

`NativeOps` is the mixin backends inherit; the modules hold one concept each (norm, rope,
activation, kv_write, routing, linear, moe, mla_attention, V4's norm / rope / compressor /
indexer / attention). Models may import the table builders here (`rope_cos_sin_cache`,
`mla_softmax_scale`, `v4_inv_freq`, `v4_cos_sin`, `ring_len`): host-side config math, not
device ops; every op they run goes through the backend.
"""

from deepinfer.backend.native.ops import NativeOps
from deepinfer.backend.native.rope import mla_softmax_scale, rope_cos_sin_cache
from deepinfer.backend.op_support import OP_NAMES

__all__ = ["NativeOps", "OP_NAMES", "mla_softmax_scale", "rope_cos_sin_cache"]
