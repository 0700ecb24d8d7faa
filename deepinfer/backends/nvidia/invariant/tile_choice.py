"""Tiles that follow the batch size, where the device shows that a row's bits do not depend on the tile.

The invariant kernels fix what decides a row's arithmetic: a GEMM's K split (the slices and their order), the MLA's
split size and online-softmax tile. Whether the MMA tile itself (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) also
decides it is a property of the hardware: a Hopper tensor core adds one 16-deep K step at a time into the fp32
accumulator, and Triton issues the steps in K order, so in a GEMM the tile should not enter a row's bits. The H200
probe (benchmarks/invariant_tile_probe.py, 2026-12-03) found exactly that for every V2-Lite weight and the MoE's
grouped GEMMs (BLOCK_M 16 to 128, BLOCK_K 64 / 128, 4 / 8 warps: the same bits at M = 1, 7, 129, 8192), and found
that it does NOT hold for the MLA attention at 64-row tiles when the softmax's row sums are tl.sum (their order
follows the register layout): there BLOCK_Q = 2 (32 rows) matched BLOCK_Q = 1 and 4 did not. With the row sums as
MMAs (mla_kernels.py, 2026-12-04) every BLOCK_Q 1 to 8 and 4 to 16 warps gave the same bits.

So this module never assumes it. A faster tile for some batch sizes is used only after the same check ran on this
device, for this weight shape, at load time (never inside a forward or a graph capture): the candidate tile and the
fixed one over the same random rows, bitwise. A failed check keeps the fixed tile for every M and logs why (a
speed loss, never a bit change). DEEPINFER_INVARIANT_TILE_FOLLOW_M=0 turns the whole mechanism off.

Tables (H200 probe, device µs at M = 8192 for the fixed plan -> this tile; cuBLAS in brackets):
- dense GEMMs at M >= LARGE_M: q + kv_a 366 -> 301 (168), o_proj 191 -> 168 (94), W_UV 63 -> 50 (46), W_UK 86 -> 81
  (53), the dense layer's gate_up 1774 -> 1339 (953) and down 859 -> 770 (454);
- the MoE's grouped GEMMs: BLOCK_M 16 with 128-deep K steps at a handful of pairs (one token: 64.9 -> 59.1 µs a
  layer with the router, layout and combine) and BLOCK_M 128 from LARGE_T tokens (8192: 3177 -> 2960 µs), with
  wider 8-warp tiles (2026-12-04, 8192 tokens at BLOCK_M 128: the dual gate_up 3121 -> 2848 µs, the down -> 2971);
- MLA (its softmax row sums are MMAs, so the tile's rows and warps stay out of a row's bits: mla_kernels.py):
  BLOCK_Q 4 on 8 warps for prefill and mixed steps (16 x 512 tokens, one layer: 0.88 -> 0.73 ms; with tl.sum row
  sums BLOCK_Q 2 was the largest that kept the bits, 0.90 ms), and 8 warps for decode's split schedule (batch 1 at
  4096 entries: 37.5 -> 34.9 µs a layer; batch 64's one-stage schedule keeps 4: 203 against 262 µs).
"""

from __future__ import annotations

import logging

import torch

from deepinfer import envs
from deepinfer.backends.nvidia.invariant.gemm import (
    BLOCK_M,
    CHECKED_LARGE_TILES,
    LARGE_M,
    Plan,
    Tile,
    bmm,
    interpreting,
    plan_for,
)

log = logging.getLogger(__name__)

LARGE_TILES_BF16: dict[tuple[int, int, int], Tile] = {  # weight [batch, N, K] -> its tile at M >= LARGE_M
    (1, 3648, 2048): Tile(BLOCK_M, 128, 64, 8, 4),  # q_proj + kv_a_proj_with_mqa (merged)
    (1, 2048, 2048): Tile(BLOCK_M, 128, 64, 8, 4),  # o_proj
    (16, 128, 512): Tile(128, 128, 64, 8, 3),  # W_UV
    (16, 512, 128): Tile(128, 128, 64, 8, 3),  # W_UK
    (1, 21888, 2048): Tile(128, 128, 64, 8, 3),  # the dense layer's gate_up
    (1, 2048, 10944): Tile(128, 256, 64, 8, 3),  # the dense layer's down
}
MOE_SMALL_PAIRS = 64  # routed + shared pairs up to which the grouped GEMMs take BLOCK_M 16 (decode, small batches)
MOE_SMALL = (16, {"dual": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
                  "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}})
MOE_LARGE_T = 2048  # tokens from which they take BLOCK_M 128 (prefill)
MOE_LARGE = (128, {"dual": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
                   "down": {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}})
MLA_PREFILL = (4, 8)  # (BLOCK_Q, warps) a program for prefill and mixed steps (decode keeps one token, 4 warps)
MLA_SPLIT_WARPS = 8  # warps of decode's split-parallel schedule (small batches; the one-stage schedule keeps 4)

_checked: dict[tuple, bool] = {}  # (kind, shape key) -> the device check passed


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreting() and envs.INVARIANT_TILE_FOLLOW_M.get()


def _record(key: tuple, same: bool, what: str) -> bool:
    _checked[key] = same
    if not same:
        log.warning("batch invariance: %s gives other bits than the fixed tile on this device; keeping the fixed "
                    "tile for every batch size (slower, same guarantee)", what)
    return same


def same_bits_gemm(w: torch.Tensor, plan: Plan, tile: Tile, rows: int) -> bool:
    """Does `tile` with plan's K split give plan's bits for w [batch, K, N] over `rows` random rows?"""
    bt, k, _ = w.shape
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(bt, rows, k, device=w.device, generator=g).to(w.dtype)
    return torch.equal(bmm(x, w, plan=plan), bmm(x, w, plan=plan, tile=tile))


def check_gemm(w: torch.Tensor) -> bool:
    """w [batch, K, N] (the view bmm multiplies by): at load, the weight's large tile against its plan's over
    LARGE_M + 76 random rows; on a match bmm takes the large tile from LARGE_M rows on. False when the weight
    has no large tile or the mechanism is off."""
    bt, k, n = w.shape
    key = ("gemm", bt, n, k)
    if key in _checked:
        return _checked[key]
    tile = LARGE_TILES_BF16.get((bt, n, k))
    if tile is None or w.dtype != torch.bfloat16 or not enabled(w.device):
        return False
    same = _record(key, same_bits_gemm(w, plan_for(bt, n, k, w.dtype), tile, LARGE_M + 76),
                   f"the GEMM tile {tile} for weight [{bt}, {n}, {k}]")
    if same:
        CHECKED_LARGE_TILES[(bt, n, k)] = tile
    return same


def moe_choice(key: tuple, num_tokens: int, slots: int) -> tuple[int | None, dict | None]:
    """(BLOCK_M, tile override) for a grouped GEMM of num_tokens x slots pairs; (None, None): the fixed ones."""
    if not _checked.get(("moe", *key)):
        return None, None
    if num_tokens * slots <= MOE_SMALL_PAIRS:
        return MOE_SMALL
    if num_tokens >= MOE_LARGE_T:
        return MOE_LARGE
    return None, None


def check_moe(key: tuple, run, device: torch.device) -> bool:
    """run(num_tokens, block_m, tile) -> the layer's output over the first num_tokens of a fixed random batch. At
    load: the small choice at 1 and 3 tokens and the large one at MOE_LARGE_T + 64 against the fixed tiles."""
    full = ("moe", *key)
    if full in _checked:
        return _checked[full]
    if not enabled(device):
        return False
    same = all(torch.equal(run(t, *MOE_SMALL), run(t, None, None)) for t in (1, 3))
    t = MOE_LARGE_T + 64
    same = same and torch.equal(run(t, *MOE_LARGE), run(t, None, None))
    return _record(full, same, f"the grouped GEMM tiles {MOE_SMALL} / {MOE_LARGE} for experts {key}")


def mla_tiles(key: tuple) -> tuple[tuple[int, int], int] | None:
    """((BLOCK_Q, warps) for prefill / mixed steps, warps of decode's split schedule) for this attention shape, or
    None: the fixed tile (one token, 4 warps) everywhere."""
    return (MLA_PREFILL, MLA_SPLIT_WARPS) if _checked.get(("mla", *key)) else None


def check_mla(key: tuple, run, device: torch.device) -> bool:
    """run(block_q, warps, two_stage) -> the attention output of a fixed random prefill, or with block_q None of
    its requests' last rows as a decode step (mla.py builds both). At load: MLA_PREFILL against the fixed tile over
    the prefill, and MLA_SPLIT_WARPS against 4 warps over the decode step in the split schedule."""
    full = ("mla", *key)
    if full in _checked:
        return _checked[full]
    if not enabled(device):
        return False
    same = torch.equal(run(*MLA_PREFILL, False), run(1, 4, False))
    same = same and torch.equal(run(None, MLA_SPLIT_WARPS, True), run(None, 4, True))
    return _record(full, same, f"MLA (BLOCK_Q, warps) {MLA_PREFILL} / split-schedule warps {MLA_SPLIT_WARPS} at {key}")


def reset() -> None:
    """Forget every check (tests)."""
    _checked.clear()
    CHECKED_LARGE_TILES.clear()
