"""Compile the MLA split-KV decode kernel over an fp8 (e4m3) KV cache for sm_90 without a GPU (no launch), its dots
in bf16 (default) and in fp16 (DEEPINFER_MLA_FP8_KV_DOT=fp16), at the launches V2-Lite's decode takes (batch 256:
one split, 32-token tiles, 4 warps, 3 stages; batch 1: 20 splits, 64-token tiles, 8 warps, 2 stages), and print
one JSON line per kernel (registers, stack). Run with TRITON_INTERPRET unset; used by test_nvidia_moe_compile.py.
The interpreter cannot catch compiled-mode type errors (the fp16 path's exponent-bit scale among them)."""

from __future__ import annotations

import inspect
import os
import sys

from moe_sm90_compile import compile_one

from deepinfer.backends.nvidia import mla_decode as m

POINTERS = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "table_ptr": "*i32", "seq_lens_ptr": "*i32",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32"}
# (splits, block_n, warps, stages) of decode_params at V2-Lite (16 heads) and a 1280-token context
LAUNCHES = {"b256": (1, 32, 4, 3), "b1": (20, 64, 8, 2)}


def main() -> None:
    kernel = m._mla_decode_split_kernel
    sig = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if name in POINTERS:
            sig[name] = POINTERS[name]
        elif param.annotation is not inspect.Parameter.empty:
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name in ("scale_log2", "kv_scale") else "i32"
    for dot in ("bf16", "fp16"):
        for label, (splits, block_n, warps, stages) in LAUNCHES.items():
            direct = splits == 1
            consts = dict(L=512, R=64, BLOCK_R=64, PAGE=64, BLOCK_H=m.BLOCK_H, BLOCK_N=block_n, UPCAST=False,
                          PREC=None, DIRECT=direct, FUSED_MERGE=not direct, BLOCK_S=32 if not direct else 1,
                          MERGE_L=64, KV_FP8=True, KV_F16=dot == "fp16")
            compile_one(f"mla_decode fp8 cache, {dot} dots, {label}", kernel, sig, consts, warps, stages)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET")
    main()
