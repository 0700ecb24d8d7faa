"""Compile the dense quantized-linear Triton kernels (quant/) for sm_90 without a GPU and print one JSON line per
kernel: shared memory, registers, stack bytes, and the count of the SASS instructions that say which path the
compiler took (QGMMA: fp8 wgmma; HGMMA: bf16 wgmma; HMMA: mma.sync; I2F: integer -> float conversions).
Run with TRITON_INTERPRET unset; used by test_quant_compile.py."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepinfer.backends.nvidia.quant import fp8_act_quant, fp8_gemm, int4_gemm, split_k

OPS = ("QGMMA", "HGMMA", "HMMA", "I2F", "LDL", "STL")


def report(label: str, kernel) -> None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    line = next(ln for ln in res.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\*/\s+([A-Z0-9_]+)", sass))
    print(json.dumps({"kernel": label, "shared": kernel.metadata.shared, "regs": int(fields["REG"]),
                      "stack": int(fields["STACK"]), **{op: ops[op] for op in OPS}}), flush=True)


def compile_one(label, fn, sig, consts, warps, stages, aligned=("N", "K")):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n.startswith("stride") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    report(label, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": warps, "num_stages": stages}))


def main() -> None:
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16",
           "bias_ptr": "*bf16", **{n: "i32" for n in ("M", "N", "K", "KB_PER", "stride_am", "stride_bn", "stride_cm",
                                                       "stride_as", "stride_bs")}}
    for mode, m in ((2, 1), (2, 64), (1, 1024)):  # decode (A quantized on load), prefill (A e4m3 given)
        bm, bn, warps, stages = fp8_gemm.tiles(m, 3072, True)
        consts = {"HAS_BIAS": False, "A_MODE": mode, "ROUND_FIRST": False, "BLOCK_M": bm, "BLOCK_N": bn,
                  "BLOCK_K": 128, "GROUP_M": 8}
        compile_one(f"fp8_gemm mode={mode} M={m} BM={bm}", fp8_gemm._fp8_gemm_kernel,
                    {**sig, "a_ptr": "*fp8e4nv" if mode == 1 else "*bf16"}, consts, warps, stages)
    bm, bn, warps, stages = fp8_gemm.tiles(1, 2048, True)  # a split of K (quant/split_k.py): fp32 partials
    compile_one(f"fp8_gemm split M=1 BM={bm}", fp8_gemm._fp8_gemm_kernel, {**sig, "a_ptr": "*bf16", "c_ptr": "*fp32"},
                {"HAS_BIAS": False, "A_MODE": 2, "ROUND_FIRST": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128,
                 "GROUP_M": 8}, warps, stages)
    compile_one("split_k reduce", split_k._reduce_kernel, {"ws_ptr": "*fp32", "c_ptr": "*bf16", "bias_ptr": "*bf16",
                                                            "MN": "i32", "N": "i32"},
                {"SPLIT": 4, "HAS_BIAS": True, "BLOCK": 1024}, 4, 1, aligned=())
    compile_one("act_quant", fp8_act_quant._act_quant_kernel,
                {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                 **{n: "i32" for n in ("M", "M_OUT", "K", "stride_x", "stride_q", "stride_sm", "stride_sg")}},
                {"ROUND_FIRST": False, "ROWS": 16, "GROUP": 128}, 4, 1, aligned=("K",))
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32", "c_ptr": "*bf16",
           "bias_ptr": "*bf16", **{n: "i32" for n in ("M", "N", "K", "KB_PER", "stride_xm", "stride_cm", "stride_wn",
                                                       "stride_sn")}}
    for gidx, m in ((False, 1), (False, 256), (True, 1)):
        bm, bn, warps, stages = int4_gemm.tiles(m, 3072, True)
        consts = {"HAS_BIAS": False, "UPCAST": False, "PREC": None, "GIDX": gidx, "GROUP": 128, "BLOCK_M": bm,
                  "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8}
        compile_one(f"int4_gemm gidx={gidx} M={m} BM={bm}", int4_gemm._int4_gemm_kernel, sig, consts, warps, stages)
    compile_one("int4_gemv", int4_gemm._int4_gemv_kernel,
                {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "c_ptr": "*bf16", "bias_ptr": "*bf16",
                 **{n: "i32" for n in ("N", "K", "stride_wn", "stride_sn")}},
                {"HAS_BIAS": False, "GROUP": 128, "BLOCK_N": int4_gemm.GEMV_BLOCK_N, "BLOCK_K": 128}, 4, 1,
                aligned=("N", "K"))
    compile_one("int4_dequant", int4_gemm._int4_dequant_kernel,
                {"w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32", "out_ptr": "*bf16",
                 **{n: "i32" for n in ("N", "stride_wn", "stride_sn", "stride_on")}},
                {"GIDX": False, "GROUP": 128, "BLOCK_N": 64, "BLOCK_K": 128}, 4, 1, aligned=("N",))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET")
    main()
