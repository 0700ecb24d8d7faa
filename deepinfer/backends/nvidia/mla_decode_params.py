"""Launch parameters of the MLA decode kernel (mla_decode.py): split count, tile, warps and stages.

They depend only on host-known sizes (batch size, heads, the block table's width), never on device
values, so a captured CUDA graph keeps a valid launch. The table comes from the H200 sweep of
benchmarks/kernels_mla.py; environment overrides exist for such sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import triton

from deepinfer import envs

BLOCK_H = 16  # heads per program: tl.dot needs >= 16 rows


def default_num_splits(batch_size: int, num_heads: int, block_h: int = BLOCK_H, num_sms: int = 132) -> int:
    """About four programs per SM, a power of two <= 32; depends on batch size only (graph-safe).

    Measured on H200 at batch 64, 4k context: 5 splits 1.9 TB/s, 8 splits 2.6, 16 splits 2.4.
    """
    head_blocks = triton.cdiv(num_heads, block_h)
    want = max(1, (4 * num_sms) // max(1, batch_size * head_blocks))
    return min(32, 1 << (want.bit_length() - 1))  # a power of two: 64 sequences x 16 heads -> 8


@dataclass(frozen=True)
class DecodeParams:
    num_splits: int  # programs per (sequence, head block): the launch shape
    block_n: int  # cache tokens per tile
    min_split: int  # fewest tokens a sequence gives one split (device-side; a multiple of block_n)
    num_warps: int = 4
    num_stages: int = 3


@lru_cache(maxsize=1)
def env_overrides() -> tuple[int | None, int | None, int | None]:
    """(splits, block_n, min_split) from DEEPINFER_MLA_SPLITS / _BLOCK_N / _MIN_SPLIT (deepinfer/envs.py checks
    them: splits / min_split >= 1, block_n a power of two >= 16); read once."""
    return envs.MLA_SPLITS.get(), envs.MLA_BLOCK_N.get(), envs.MLA_MIN_SPLIT.get()


# (largest batch, splits launched, min tokens per split, tile, warps, stages): from the H200 sweep of
# benchmarks/kernels_mla.py (V2-Lite, 16 heads, bf16, graph-sized tables; docs/perf-log/2026-11-29-*.md).
# Best there: batch 1 -> 24-64 splits of 64-token tiles; 16 -> 8 splits of 64; 64 -> 4 splits of
# 32-token tiles since the merge runs in the split kernel (1536: 52 us vs 60 with the merge kernel;
# 2048: 63 vs 71; 4k: 116 us, 2.6 TB/s; end to end at batch 64: 6,262 tok/s vs 6,114 with 2-3 splits
# of 64-token tiles); 256 -> 1 split of 32-token tiles (no merge: 145 us vs 175 us at 1536). Rows
# between are interpolated, not measured.
_DECODE_TABLE = (
    (2, 64, 64, 64, 8, 2),
    (8, 32, 64, 64, 8, 2),
    (31, 16, 128, 64, 8, 2),
    (63, 8, 256, 64, 8, 2),
    (127, 4, 32, 32, 4, 3),
    (191, 2, 1024, 32, 4, 3),
    (1 << 30, 1, 32, 32, 4, 3),
)
# Tables wider than this (long max_model_len) take 32-token tiles at batch 32..127: the 64-token
# tiles win only up to ~2k tokens.
_LONG_CONTEXT = 2304
_LONG_ROW = (4, 32, 32, 4, 2)  # splits, min split, tile, warps, stages (b64, 4k: 2.56 TB/s)


def decode_params(batch_size: int, num_heads: int, max_context: int) -> DecodeParams:
    """The launch for `batch_size` sequences of at most `max_context` tokens (host-known: the block table's
    width; in a captured graph that is max_model_len, so the launch then depends on the batch and the
    longest context the graph can meet).

    The table above gives the launched splits and each split's minimum length: a sequence uses
    min(splits, ceil(len / min_split)) of them (device-side), so short contexts take fewer, longer
    splits without a new graph. An eager batch never launches more splits than its table covers.
    """
    splits_env, block_env, min_env = env_overrides()
    for max_batch, t_splits, t_min, t_block, warps, stages in _DECODE_TABLE:
        if batch_size <= max_batch:
            break
    if 32 <= batch_size <= 127 and max_context > _LONG_CONTEXT:
        t_splits, t_min, t_block, warps, stages = _LONG_ROW
    block_n = block_env or t_block
    if block_env is not None and block_env != t_block:  # an overridden tile gets its usual warps / stages
        warps, stages = (8, 2) if block_n >= 64 else (4, 3)
    min_split = triton.cdiv(min_env or t_min, block_n) * block_n
    if splits_env is not None:
        splits = splits_env
    else:
        splits = max(1, min(t_splits, triton.cdiv(max(1, max_context), min_split)))
    return DecodeParams(num_splits=splits, block_n=block_n, min_split=min_split, num_warps=warps,
                        num_stages=stages)
