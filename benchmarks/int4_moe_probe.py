"""Where the int4 direct MoE GEMM's time goes at one token (issue 18's int4 batch-1 goal).

    python -m benchmarks.int4_moe_probe [--splits 1,2,4] [--block-n 16,32,64] [--unroll 1,4] [--json out.jsonl] [--dry-run]

Why: on the H200 the int4 direct GEMMs at one token streamed ~1 TB/s of int4 weight whatever their tile
(docs/quantization.md), a quarter of the copy bandwidth, so int4 decode at batch 1 ran 1.02x of bf16 where the
goal is 1.5x. Two explanations predict different fixes: too few programs to keep enough bytes in flight (a batch-1
gate_up has 8 expert slots x 44 column tiles: ~2.7 programs an SM; fix: more programs, K split), or the dequant's
ALU work per weight (nibble extraction, the interleave into K order, 2^23-offset conversion, zero point, scale,
rounding to bf16: ~6 instructions a weight, against the ~3.7 the H200's lanes can spend per weight at 4 TB/s of
int4; fix: fewer instructions a weight). This times, over the gate_up weights of 8 expert slots (V2-Lite:
[2 x 1408, 2048] int4 g128, the direct schedule's batch-1 slots), with weight copies rotated past the L2:

- `engine`: `direct_gemm` as the MoE op runs it (dual gate_up, SiLU-and-mul), its default tile; `engine_gemv`
  the same through its GEMV mainloop (DEEPINFER_INT4_GEMV; quant/tiles.py int4_row_dot);
- `stream`: a kernel that only loads the same bytes over the same grid and sums them as integers: the
  bandwidth this grid reaches when the ALU work is ~nothing;
- `dequant`: the same grid dequantizing as `quant/tiles.py int4_row_dot` does (interleave, fp32), one row of
  activations, products accumulated in fp32 registers and reduced once at the end;
- `planes`: the same without the interleave: the low and high nibbles multiply the even and odd activations
  (loaded as two strided vectors), so no K-order shuffle happens;
- `scaled`: the bytes with their zero points and scales loaded, one add and one FMA a byte, no nibbles;
- `planes_nox`: planes' arithmetic with the activations two scalars loaded once (no loads of x in the loop);
- `words`: int32 words, each nibble made the fp32 1 + q / 16 by a shift and a mask-and-or, one FMA a weight, the
  zero point and the 1 taken out per group through the group's sum of x (`_words_kernel`);

each at BLOCK_N, K-split and unroll (64-byte K tiles loaded a loop trip) choices (a split writes fp32 partials;
the reduction is not timed: it is what a split would add, a few us). Prints device us and weight GB/s per row.
--dry-run: tiny shapes under TRITON_INTERPRET=1, every kernel's partial sums checked against torch (no timing).

Measured on an H100 (2026-12-06, docs/perf-log/2026-12-06-session26-h100.md): engine 23.6 us, stream 9.4-13.9,
scaled 11.6-22.0, dequant and planes 19.9-26.9, planes_nox 18.7-26.1, words 20.5-29.7 (and the engine's GEMV
mainloop rewritten the words way, 39.8 us against 22-24 for its MMA mainloop: not kept). Neither the grid, the
interleave nor ~40% fewer PTX instructions a weight moved the dequantizing kernels; the nibble arithmetic in fp32
costs ~7-10 us over the scaled byte stream, the activation loads ~2-3.
"""

from __future__ import annotations

import argparse
import json
import os

import triton
import triton.language as tl

SLOTS, INTER, HIDDEN, GROUP = 8, 1408, 2048, 128


@triton.jit
def _probe_kernel(w_ptr, z_ptr, s_ptr, x_ptr, out_ptr, N, KB, stride_e, stride_n, stride_se, stride_sn,
                  MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
                  GROUP_B: tl.constexpr, UNROLL: tl.constexpr):
    """Program (slot, column tile, split): rows [BLOCK_N] of slot's weight [N, KB bytes], bytes of its split.
    out[split, slot, row] = the split's partial sum (MODE 0: the bytes as integers; 1, 2: W x)."""
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(2)
    nmask = rows < N
    span = KB // SPLIT
    w_base = w_ptr + slot * stride_e + rows[:, None].to(tl.int64) * stride_n
    offs_b = tl.arange(0, BLOCK_KB)
    x_even = tl.load(x_ptr).to(tl.float32)  # MODE 4's activations
    x_odd = tl.load(x_ptr + 1).to(tl.float32)
    acc_i = tl.zeros([BLOCK_N, BLOCK_KB], dtype=tl.int32)
    acc_f = tl.zeros([BLOCK_N, BLOCK_KB], dtype=tl.float32)
    for b00 in range(sp * span, (sp + 1) * span, BLOCK_KB * UNROLL):
        for u in tl.static_range(UNROLL):  # UNROLL independent loads a trip: more bytes in flight per program
            b0 = b00 + u * BLOCK_KB
            byte = tl.load(w_base + b0 + offs_b[None, :], mask=nmask[:, None], other=0).to(tl.int32)
            if MODE == 0:
                acc_i += byte
            else:
                soff = slot * stride_se + rows * stride_sn + b0 // GROUP_B
                z = tl.load(z_ptr + soff, mask=nmask, other=0).to(tl.float32) + 8388608.0
                s = tl.load(s_ptr + soff, mask=nmask, other=0.0).to(tl.float32)
                if MODE == 1:  # as int4_row_dot: nibbles interleaved into K order, one activation vector
                    x = tl.load(x_ptr + 2 * b0 + tl.arange(0, 2 * BLOCK_KB)).to(tl.float32)
                    q = tl.interleave(byte & 0xF, byte >> 4)
                    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
                    part = tl.sum(tl.reshape((qf - z[:, None]) * x[None, :], [BLOCK_N, BLOCK_KB, 2]), axis=2)
                elif MODE == 2:  # planes: low nibbles with the even activations, high with the odd
                    xe = tl.load(x_ptr + 2 * (b0 + offs_b)).to(tl.float32)
                    xo = tl.load(x_ptr + 2 * (b0 + offs_b) + 1).to(tl.float32)
                    lo = ((byte & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                    hi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
                    part = (lo - z[:, None]) * xe[None, :] + (hi - z[:, None]) * xo[None, :]
                elif MODE == 4:  # planes' arithmetic, the activations two scalars loaded once (no loads of x here)
                    lo = ((byte & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                    hi = ((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
                    part = (lo - z[:, None]) * x_even + (hi - z[:, None]) * x_odd
                else:  # MODE 5: the bytes, zero points and scales loaded, one FMA a byte (no nibbles)
                    part = byte.to(tl.float32) + z[:, None]
                acc_f += part * s[:, None]
    dst = out_ptr + (sp * tl.num_programs(0) + slot) * N + rows
    if MODE == 0:
        tl.store(dst, tl.sum(acc_i, axis=1).to(tl.float32), mask=nmask)
    else:
        tl.store(dst, tl.sum(acc_f, axis=1), mask=nmask)


@triton.jit
def _words_kernel(w_ptr, z_ptr, s_ptr, x_ptr, out_ptr, N, KW, stride_e, stride_n, stride_se, stride_sn,
                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """MODE 3, `words`: the weight read as int32 words (word c: input channels 8c .. 8c + 7, nibble j = channel 8c +
    j), each nibble turned into the fp32 1 + q / 16 by one shift and one mask-and-or (its bits in the mantissa of
    1.0), one FMA a weight against x, and per 128-channel group sum (q - z) x = 16 (sum f x - X) - z X with X the
    group's sum of x: ~3 instructions a weight where the 2^23 path takes ~5. Program (slot, tile, split) as MODE 0-2."""
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(2)
    nmask = rows < N
    span = KW // SPLIT
    offs_w = tl.arange(0, 16)  # one group: 128 channels, 16 words
    w_base = w_ptr + slot * stride_e + rows[:, None].to(tl.int64) * stride_n
    res = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w0 in range(sp * span, (sp + 1) * span, 16):
        word = tl.load(w_base + w0 + offs_w[None, :], mask=nmask[:, None], other=0)
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        xsum = tl.zeros([16], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_ptr + 8 * (w0 + offs_w) + j).to(tl.float32)
            f = ((((word >> (4 * j)) & 0xF) << 19) | 0x3F800000).to(tl.float32, bitcast=True)
            acc += f * xj[None, :]
            xsum += xj
        soff = slot * stride_se + rows * stride_sn + w0 // 16
        z = tl.load(z_ptr + soff, mask=nmask, other=0).to(tl.float32)
        sc = tl.load(s_ptr + soff, mask=nmask, other=0.0).to(tl.float32)
        x_total = tl.sum(xsum, axis=0)
        res += sc * ((tl.sum(acc, axis=1) - x_total) * 16.0 - z * x_total)
    tl.store(out_ptr + (sp * tl.num_programs(0) + slot) * N + rows, res, mask=nmask)


def probe(w, z, s, x, mode: int, split: int, block_n: int, unroll: int = 1, warps: int = 4, block_kb: int = 64):
    """Launch the probe kernel over every slot of w [slots, N, KB] (uint8, two int4 a byte, low nibble first)."""
    import torch

    slots, n, kb = w.shape
    out = torch.empty(split, slots, n, device=w.device, dtype=torch.float32)
    grid = (slots, triton.cdiv(n, block_n), split)
    if mode == 3:
        words = w.view(torch.int32)
        _words_kernel[grid](words, z, s, x, out, n, kb // 4, words.stride(0), words.stride(1), s.stride(0),
                            s.stride(1), SPLIT=split, BLOCK_N=block_n, num_warps=warps)
        return out
    _probe_kernel[grid](w, z, s, x, out, n, kb, w.stride(0), w.stride(1), s.stride(0), s.stride(1), MODE=mode,
                        SPLIT=split, BLOCK_N=block_n, BLOCK_KB=block_kb, GROUP_B=GROUP // 2,
                        UNROLL=unroll, num_warps=warps)
    return out


def reference(w, z, s, x, mode: int):
    """What every probe's partial sums add up to (torch, fp32)."""
    import torch

    if mode == 0:
        return w.to(torch.float32).sum(-1)
    if mode == 5:
        zz = z.float().repeat_interleave(GROUP // 2, dim=-1) + 8388608.0
        ss = s.float().repeat_interleave(GROUP // 2, dim=-1)
        return ((w.float() + zz) * ss).sum(-1)
    if mode == 4:
        x = torch.stack([x[0], x[1]]).repeat(x.shape[0] // 2)
    q = torch.stack([w & 0xF, w >> 4], dim=-1).flatten(-2).float()  # [slots, N, K]
    zz = z.float().repeat_interleave(GROUP, dim=-1)
    ss = s.float().repeat_interleave(GROUP, dim=-1)
    return ((q - zz) * ss) @ x.float()


def make_weights(slots: int, n: int, k: int, device: str, copies: int, seed: int = 0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(copies):
        w = torch.randint(0, 256, (slots, n, k // 2), generator=g, dtype=torch.uint8)
        z = torch.randint(0, 16, (slots, n, k // GROUP), generator=g, dtype=torch.uint8)
        s = (torch.rand(slots, n, k // GROUP, generator=g) * 0.01 + 0.001).half()
        sets.append(tuple(t.to(device) for t in (w, z, s)))
    return sets


def engine_fn(sets, x, device, gemv: bool = False):
    """direct_gemm as fused_moe runs a batch-1 gate_up over `slots` routed slots (no shared experts here), its
    default tile; gemv: its GEMV mainloop (fused_moe_gemv.py, DEEPINFER_INT4_GEMV)."""
    import torch

    from deepinfer.backends.nvidia.fused_moe_config import direct_config
    from deepinfer.backends.nvidia.fused_moe_gemm import direct_gemm

    slots, n, _ = sets[0][0].shape
    ids = torch.arange(slots, device=device).view(1, slots)
    act = torch.empty(slots, n // 2, device=device, dtype=x.dtype)
    xa = x.view(1, -1)

    def fn(i):
        w, z, s = sets[i % len(sets)]
        direct_gemm(xa, w, None, act, ids, None, 0, slots, dual=True, scale=s, scheme="int4_awq", zeros=z,
                    group_size=GROUP, cfg=dict(direct_config(True, "int4_awq", GROUP), gemv=gemv))
        return act
    return fn


def run(args) -> list[dict]:
    import torch

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    slots, n, k = (2, 64, 256) if dry else (SLOTS, 2 * INTER, HIDDEN)
    per_copy = slots * n * k // 2
    copies = 1 if dry else max(2, (512 << 20) // per_copy)  # > the L2 several times over
    sets = make_weights(slots, n, k, device, copies)
    dt = torch.float16 if dry else torch.bfloat16  # the interpreter's bf16 loads are fine; fp16 keeps the check tight
    x = (torch.randn(k, generator=torch.Generator(device="cpu").manual_seed(1)) * 0.1).to(device=device, dtype=dt)
    rows = []

    def timed(fn):
        if dry:
            fn(0)
            return 0.0
        from benchmarks.graph_timing import rotating_graph_us
        return rotating_graph_us(fn, copies, reps=min(40, 4 * copies))

    for gemv in (False, True):
        us = timed(engine_fn(sets, x, device, gemv))
        rows.append({"kernel": "engine_gemv" if gemv else "engine", "split": 1, "block_n": None, "us": round(us, 2)})
    for mode, name in ((0, "stream"), (5, "scaled"), (1, "dequant"), (2, "planes"), (4, "planes_nox"),
                       (3, "words")):
        for split in args.splits:
            for bn in args.block_n:
                for unroll in args.unroll:
                    if (k // 2) % (split * 64 * unroll) or (mode == 3 and unroll > 1):
                        continue  # (words: one group a trip, no unroll)
                    fn = lambda i, m=mode, sp=split, b=bn, u=unroll: probe(*sets[i % copies], x, m, sp, b, u)
                    row = {"kernel": name, "split": split, "block_n": bn, "unroll": unroll, "us": round(timed(fn), 2)}
                    if dry:
                        got = fn(0).sum(0)
                        want = reference(*sets[0], x, mode)
                        row["max_err"] = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
                    rows.append(row)
    for r in rows:
        r["weight_gbs"] = round(per_copy / r["us"] / 1e3, 1) if r["us"] else None
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", default="1,2,4", type=lambda v: [int(t) for t in v.split(",")])
    ap.add_argument("--block-n", default="16,32,64", type=lambda v: [int(t) for t in v.split(",")])
    ap.add_argument("--unroll", default="1,4", type=lambda v: [int(t) for t in v.split(",")],
                    help="64-byte K tiles loaded per loop trip")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = run(args)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
