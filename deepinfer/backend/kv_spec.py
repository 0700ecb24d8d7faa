"""What one KV group stores per token, how long it keeps it, and its per-sequence state; and how a
group stored in fp8 (`EngineConfig.kv_cache_dtype="fp8"`, docs/quantization.md "fp8 KV cache") is
quantized on write and dequantized on read.

fp8 entries are float8_e4m3fn with one per-layer scale for the whole entry (MLA: the latent and the
rope part alike, as vLLM's MLA cache does with its `k_scale`): stored = clamp(x / scale, ±448) rounded
to nearest even, read back as stored * scale. The clamp is explicit because the kernels' conversions
differ at overflow (torch saturates, a bare PTX cvt without .satfinite gives NaN): clamping first makes
every backend store the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# canonical KV-cache dtype names (EngineConfig.kv_cache_storage(), BackendCaps.kv_cache_dtypes) -> the storage
# dtype (None: the compute dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def quantize_kv(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """values in the storage dtype: a plain cast for a compute-dtype cache; for fp8, (values / scale) in
    fp32, clamped to ±448, rounded to nearest even (torch's cast). The reference every backend matches."""
    if not is_fp8_kv(dtype):
        return values.to(dtype)
    x = values.float()
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache rows as fp32: stored * scale for fp8 (exact: every e4m3 value is an fp32), else a cast."""
    x = stored.float()
    return x * scale if is_fp8_kv(stored.dtype) and scale != 1.0 else x


@dataclass(frozen=True)
class KVCacheSpec:
    """One KV group: layers that share a block table because they store alike.

    - full attention (V3 MLA): tokens_per_entry=1, sliding_window=None;
    - sliding window W: only entries of the last W tokens are kept, older
      blocks return to the pool;
    - compressed (V4 CSA/HCA, indexer keys): one entry per `tokens_per_entry`
      tokens, paged and append-only; entry e covers tokens [e*m, (e+1)*m).
    `state_shape` is fixed-size per-sequence state per layer (V4 compressor
    buffers and overlap), held in a pool of max_num_seqs rows, not in blocks.
    `components` names the parts of an entry's last dimension, in order (V3's MLA group:
    ("latent", 512), ("rope", 64)), so a backend may store them apart (KVLayout.split_components).
    """

    name: str
    layer_ids: tuple[int, ...]
    entry_shape: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_entry: int = 1
    sliding_window: int | None = None
    state_shape: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32
    components: tuple[tuple[str, int], ...] = ()

    def num_entries(self, num_tokens: int) -> int:
        """Entries that exist once `num_tokens` tokens are in the cache."""
        return num_tokens // self.tokens_per_entry

    def first_live_entry(self, num_tokens: int) -> int:
        """Oldest entry still needed when the next token is at position num_tokens."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_tokens - self.sliding_window + 1) // self.tokens_per_entry)

    def bytes_per_entry(self) -> int:
        """Bytes of one entry across all layers of the group."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return math.prod(self.entry_shape) * elem * len(self.layer_ids)

    def bytes_per_token(self) -> float:
        """Average bytes per token across the group's layers (0 for fixed-size windows)."""
        if self.sliding_window is not None:
            return 0.0
        return self.bytes_per_entry() / self.tokens_per_entry

    def state_bytes_per_seq(self) -> int:
        if not self.state_shape:
            return 0
        elem = torch.empty((), dtype=self.state_dtype).element_size()
        return math.prod(self.state_shape) * elem * len(self.layer_ids)
