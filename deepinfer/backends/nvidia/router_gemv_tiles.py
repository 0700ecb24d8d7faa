"""Tile choice for the router-logits GEMV kernels (moe_routing.py): the per-token GEMV and the
token-tiled one, plus the DEEPINFER_ROUTER_GEMV override the kernel benchmark sweeps with.

Host-side only (sizes in, tile out), so it is kept apart from the kernels."""

from __future__ import annotations

import triton

from deepinfer import envs

ROUTER_GEMV_ENV_FORMATS = ("'BLOCK_E,BLOCK_D,num_warps' (the per-token GEMV, then used at every size) or "
                           "'BLOCK_T,BLOCK_E,BLOCK_D,num_warps[,num_stages]' (the token-tiled GEMV, 2..512 tokens)")
TILED_MIN_PROGRAMS = 128  # about one wave on the H200's 132 SMs
TILED_STAGES = 4  # chunks in flight per program (cp.async pipeline of the D loop)


def _router_gemv_env() -> tuple[int, ...] | None:
    """DEEPINFER_ROUTER_GEMV, checked (tuning / A/B runs). Three values, 'BLOCK_E,BLOCK_D,num_warps': the
    per-token GEMV's tile (gate_route's too), and router_logits uses the per-token GEMV at every size, as
    before the tiled kernel. Four or five, 'BLOCK_T,BLOCK_E,BLOCK_D,num_warps[,num_stages]': the token-tiled
    kernel's tile for 2..512 tokens; the per-token GEMV (one token, gate_route) keeps its default."""
    env = envs.ROUTER_GEMV.get()  # the raw string; checked here
    if not env:
        return None
    from deepinfer.errors import BackendError

    def bad(problem: str) -> BackendError:
        return BackendError(f"DEEPINFER_ROUTER_GEMV={env!r}: {problem}; expected {ROUTER_GEMV_ENV_FORMATS}")

    try:
        values = tuple(int(v) for v in env.split(","))
    except ValueError:
        raise bad("not comma-separated integers") from None
    if len(values) not in (3, 4, 5):
        raise bad(f"{len(values)} values")
    warps_at = 2 if len(values) == 3 else 3
    for i, v in enumerate(values[:warps_at + 1]):
        if v < 1 or v & (v - 1):
            what = "num_warps" if i == warps_at else "block sizes"
            raise bad(f"{what} must be powers of two >= 1, got {v}")
    if values[warps_at] > 32:
        raise bad(f"num_warps must be <= 32, got {values[warps_at]}")
    if len(values) == 5 and not 1 <= values[4] <= 8:
        raise bad(f"num_stages must be in [1, 8], got {values[4]}")
    return values


def _gemv_tile(D: int, tokens: int = 1) -> tuple[int, int, int]:
    """The per-token GEMV's (BLOCK_E, BLOCK_D, num_warps): many small programs, few iterations.

    Up to 16 tokens (gate_route's sizes): one expert a program, one warp, 512-wide chunks (V2-Lite: 64 programs a
    token x 4 steps). On an H100 (2026-12-06, session 32, benchmarks.b1_small_kernels: gate_route with its top-k,
    graph replays over cold gates) 4.5-4.7 / 5.2 / 6.0 us a call at 1 / 4 / 16 tokens against 6.7 / 7.0 / 7.6 for
    (2, 1024, 4), and the batch-1 decode step 0.09 ms shorter: one warp a program makes each token's last program's
    top-k (six argmax rounds over 64 experts) warp shuffles, with no shared-memory barrier. More tokens (the
    per-token GEMV at every size: a 3-value DEEPINFER_ROUTER_GEMV, or gate_route raised past 16 for an A/B) keep
    (2, 1024, 4), not re-timed."""
    tile = _router_gemv_env()
    if tile is not None and len(tile) == 3:
        return tile
    if tokens <= 16:
        return 1, min(512, triton.next_power_of_2(D)), 1
    return 2, min(1024, triton.next_power_of_2(D)), 4


def _tiled_gemv_tile(T: int, E: int, D: int, x_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """The token-tiled GEMV's (BLOCK_T, BLOCK_E, BLOCK_D, num_warps, num_stages).

    Tiles up to 8 tokens x 4 experts: the grid first needs about one program per SM (latency: each
    program is a chain of D / BLOCK_D pipelined steps), then the least L2 traffic, x_bytes / BLOCK_E +
    4 / BLOCK_T bytes per logit (the fp32 gate, cold in HBM, is read T / BLOCK_T times), ties to more
    tokens. V2-Lite at 64 tokens: 8 x 4, 128 programs reading 64 KB each (8 MB from L2 in all, against
    2048 programs x 20 KB = 42 MB for the per-token GEMV), 8 KB per 256-wide chunk, 3 chunks in flight.
    """
    tile = _router_gemv_env()
    if tile is not None and len(tile) >= 4:
        return tile if len(tile) == 5 else (*tile, TILED_STAGES)
    best = None
    for block_t in (b for b in (1, 2, 4, 8) if b <= triton.next_power_of_2(T)):
        for block_e in (b for b in (1, 2, 4) if b <= triton.next_power_of_2(E)):
            programs = triton.cdiv(T, block_t) * triton.cdiv(E, block_e)
            key = (min(programs, TILED_MIN_PROGRAMS), -(x_bytes / block_e + 4 / block_t), block_t)
            if best is None or key > best[0]:
                best = key, block_t, block_e
    _, block_t, block_e = best
    # ~64 accumulators per thread (4 warps): 8 x 4 tiles step 256 wide, small tiles up to 1024 (fewer steps)
    block_d = min(triton.next_power_of_2(D), 1024, max(256, 64 * 32 * 4 // (block_t * block_e)))
    return block_t, block_e, block_d, 4, TILED_STAGES
