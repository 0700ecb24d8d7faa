"""Compile the MoE Triton kernels for sm_90 without a GPU (no launch) and print one JSON line per kernel:
shared memory, registers and stack (spill) bytes from the cubin. Run with TRITON_INTERPRET unset; used by
test_nvidia_moe_compile.py. The interpreter cannot catch compiled-mode type errors; this can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepinfer.backends.nvidia import fused_moe as fm
from deepinfer.backends.nvidia import fused_moe_config as cfgs
from deepinfer.backends.nvidia import fused_moe_gemm as g
from deepinfer.backends.nvidia import moe_routing as r
from deepinfer.backends.nvidia.quant import fp8_act_quant as aq

ALIGNED = ("N", "K", "D", "E", "u_off", "us_off", "shared_step")  # multiples of 16 at DeepSeek shapes


def resources(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def compile_one(label, fn, sig, consts, warps, stages):
    # runtime launches specialise 16-divisible pointers / ints; without the hint loads are not vectorised
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n.startswith("stride") or n in ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    print(json.dumps({"kernel": label, "shared": k.metadata.shared, "wgmma": "wgmma" in k.asm["ptx"],
                      **resources(k.asm["cubin"])}), flush=True)


# weight scheme -> (weight pointer type, scale pointer type, E8M0): None = the activation dtype, no scale
# (the kernel then reads its scale pointer as the weight itself, never dereferenced)
WEIGHTS = {None: (None, None, False), "fp8_block": ("fp8e4nv", "fp32", False), "fp8_w8a8": ("fp8e4nv", "fp32", False),
           "fp4": ("u8", "u8", True), "int4_awq": ("u8", "fp16", False)}


def _weight_args(dt: str, scheme, gidx: bool = False):
    wt, qt, e8m0 = WEIGHTS[scheme]
    # z_ptr: int4's uint8 zero points; other schemes pass the scale tensor there (never dereferenced); g_ptr: GPTQ
    # act-order's int32 groups (GIDX), else the scale tensor again
    zt = "*u8" if scheme == "int4_awq" else "*" + (qt or dt)
    sig = {"q_ptr": "*" + (qt or dt), "z_ptr": zt,
           **{n: "i32" for n in ("uq_off", "stride_qe", "stride_qn", "stride_qk")},
           "g_ptr": "*i32" if gidx else "*" + (qt or dt), "stride_ge": "i32"}
    return "*" + (wt or dt), sig, {"QUANT": cfgs.QUANT_CODES[scheme], "E8M0": e8m0, "GROUP": 128, "GIDX": gidx,
                                   "A_MODE": 2 if scheme in cfgs.FP8_ACT else 0, "ROUND_FIRST": False}


def direct(dt, dual, P, BM, cfg, combine=False, scheme=None, gidx=False):
    b_type, qsig, qconsts = _weight_args(dt, scheme, gidx)
    # quantized routed experts fold their shared experts in as stacked slots: bs_ptr points into the same weights
    sig = {"a_ptr": "*" + dt, "b_ptr": b_type, "bs_ptr": b_type if scheme else "*" + dt, "c_ptr": "*" + (dt if dual else "fp32"),
           "w_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*" + dt, "s_ptr": "*" + dt, "cnt_ptr": "*i32",
           **{n: "i32" for n in (
               "N", "K", "num_pairs", "num_experts", "u_off", "us_off", "shared_step", "stride_am", "stride_be",
               "stride_bn", "stride_sn", "stride_cm", "stride_o", "stride_s")}, **qsig}
    consts = {"TOP_K": 6, "SLOTS": 8, "A_DIV": 8 if dual else 1, "DUAL": dual, "MUL_WEIGHT": not dual,
              "UPCAST": False, "PREC": "ieee" if dt == "fp32" else None, **qconsts,
              "SHARED_STACKED": scheme is not None and not gidx, "COMBINE": combine,
              "HAS_SHARED": combine, "BLOCK_P": P, "BLOCK_M": BM, "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
              "SWAP_AB": cfg.get("swap_ab", False), "GEMV": cfg.get("gemv", False)}
    sig.update({k: "constexpr" for k in consts})
    compile_one(f"direct {dt} {scheme or 'dense'}{' act-order' if gidx else ''} dual={dual} combine={combine} P={P} "
                f"BM={BM} {cfg}",
                g._direct_gemm_kernel, sig, consts, cfg["num_warps"], cfg["num_stages"])


TL = {"bf16": tl.bfloat16, "fp32": tl.float32}


def aligned(dt, dual, BM, cfg, scheme=None, split_gate_up=False, gidx=False):
    """fp8_w8a8: A e4m3 with scales (mode 1); the gate_up writes e4m3 + scales (ACT_FP8_OUT). split_gate_up: the
    W8A8 gate_up as one GEMM over both halves (not dual, no routing weight, out in the compute dtype). gidx: int4
    GPTQ act-order's gate_up (zero points and scales gathered per input channel)."""
    b_type, qsig, qconsts = _weight_args(dt, scheme, gidx)
    w8a8 = scheme in cfgs.FP8_ACT
    a_type = "*fp8e4nv" if w8a8 else "*" + dt
    c_type = ("*fp8e4nv" if w8a8 else "*" + dt) if dual else ("*" + dt if split_gate_up else "*fp32")
    sig = {"a_ptr": a_type, "b_ptr": b_type, "c_ptr": c_type, "w_ptr": "*fp32",
           "sorted_ptr": "*i32", "expert_ptr": "*i32", "npad_ptr": "*i32", **{n: "i32" for n in (
               "N", "K", "num_pairs", "u_off", "stride_am", "stride_be", "stride_bn", "stride_cm")}, **qsig,
           "as_ptr": "*fp32", "stride_as": "i32", "cs_ptr": "*fp32", "stride_cs": "i32"}
    consts = {"A_DIV": 6 if dual or split_gate_up else 1, "DUAL": dual, "MUL_WEIGHT": not (dual or split_gate_up),
              "UPCAST": False,
              "PREC": "ieee" if dt == "fp32" else None, **qconsts, "A_MODE": 1 if w8a8 else 0,
              "ACT_FP8_OUT": w8a8 and dual, "ACT": TL[dt], "BLOCK_M": BM, "BLOCK_N": cfg["block_n"],
              "BLOCK_K": cfg["block_k"], "SWAP_AB": cfg.get("swap_ab", False), "GROUP_M": cfg.get("group_m", 0)}
    sig.update({k: "constexpr" for k in consts})
    sig["num_m"] = "i32"
    label = "split gate_up" if split_gate_up else f"dual={dual}"
    compile_one(f"aligned {dt} {scheme or 'dense'}{' act-order' if gidx else ''} {label} BM={BM} {cfg}",
                g._aligned_gemm_kernel, sig,
                consts, cfg["num_warps"], cfg["num_stages"])


def main() -> None:
    for dual in (True, False):
        direct("bf16", dual, 8, 16, g.direct_config(dual))  # batch 1: 6 routed + 2 shared pairs
        direct("bf16", dual, 128, 16, g.direct_config(dual))  # batch 10
        for bm in (16, 32, 64, 128):  # 128: the 16-bit prefill tile (fused_moe.pick_block_m)
            aligned("bf16", dual, bm, g.gemm_config(bm, dual))
    direct("bf16", False, 8, 16, g.direct_config(False), combine=True)
    direct("bf16", False, 128, 16, g.direct_config(False), combine=True)
    direct("fp32", True, 8, 16, g.direct_config(True))
    for scheme in ("fp8_block", "fp4", "int4_awq", "fp8_w8a8"):  # quantized routed experts, compiled
        for dual in (True, False):
            direct("bf16", dual, 8, 16, g.direct_config(dual, scheme), scheme=scheme)
            aligned("bf16", dual, 32, g.gemm_config(32, dual, scheme), scheme=scheme)
    # GPTQ act-order int4 gate_up (w13_g_idx: the zero points and scales gathered per input channel)
    direct("bf16", True, 8, 16, cfgs.gidx_config(g.direct_config(True, "int4_awq")), scheme="int4_awq", gidx=True)
    aligned("bf16", True, 32, cfgs.gidx_config(g.gemm_config(32, True, "int4_awq")), scheme="int4_awq", gidx=True)
    for dual in (True, False):  # W8A8 prefill tiles (BLOCK_M 64: QGMMA)
        aligned("bf16", dual, 64, g.gemm_config(64, dual, "fp8_w8a8"), scheme="fp8_w8a8")
    # the grouped program order (DEEPINFER_MOE_GROUP_M)
    aligned("bf16", True, 64, dict(g.gemm_config(64, True, "fp8_w8a8"), group_m=8), scheme="fp8_w8a8")
    aligned("bf16", True, 128, g.gemm_config(128, True, "fp8_w8a8"), scheme="fp8_w8a8")  # the prefill gate_up
    # the split W8A8 gate_up at prefill sizes (fused_moe.split_gate_up: 128 rows, one accumulator) and the
    # SiLU-and-mul + quant kernel between it and the down GEMM
    aligned("bf16", False, fm.SPLIT_GATE_UP_BLOCK_M, cfgs.split_gate_up_config(fm.SPLIT_GATE_UP_BLOCK_M),
            scheme="fp8_w8a8", split_gate_up=True)
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "scm_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32",
           "M_OUT": "i32", "I": "i32", "stride_x": "i32", "stride_q": "i32", "stride_s": "i32", "stride_cm": "i32",
           "stride_y": "i32", "ACT": "constexpr", "ROUND_FIRST": "constexpr", "ROWS": "constexpr",
           "GROUP": "constexpr", "WRITE_CM": "constexpr", "WRITE_Y": "constexpr"}
    for write in (False, True):  # the split gate_up's (fused_moe.py); an MLP's, for its W8A8 down (Fp8Act)
        compile_one(f"silu_mul_quant_fp8{' fp8_act' if write else ''}", aq._silu_mul_quant_kernel, sig,
                    {"ACT": tl.bfloat16, "ROUND_FIRST": False, "ROWS": 16, "GROUP": 128, "WRITE_CM": write,
                     "WRITE_Y": write}, 4, 1)
    # the RMSNorm that writes its e4m3 quantization (quant/rmsnorm_fp8.py) at V2-Lite's hidden 2048
    from deepinfer.backends.nvidia.quant import rmsnorm_fp8 as rn

    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
           "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "scm_ptr": "*fp32", "M": "i32", "D": "i32", "stride_x": "i32",
           "stride_r": "i32", "stride_o": "i32", "stride_s": "i32", "stride_q": "i32", "stride_sm": "i32",
           "stride_cm": "i32", "eps": "fp32", "HAS_RES": "constexpr", "ROUND_FIRST": "constexpr",
           "BLOCK_D": "constexpr", "GROUP": "constexpr"}
    compile_one("rms_norm_fp8", rn._rms_norm_fp8_kernel, sig,
                {"HAS_RES": True, "ROUND_FIRST": False, "BLOCK_D": 2048, "GROUP": 128}, 8, 1)
    for dual in (True, False):  # W8A8 at decode sizes: swap-AB (the default below BLOCK_M 64), the unswapped tile
        aligned("bf16", dual, 16, g.gemm_config(16, dual, "fp8_w8a8"), scheme="fp8_w8a8")
        unswapped = {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3 if dual else 4, "swap_ab": False}
        aligned("bf16", dual, 32, unswapped, scheme="fp8_w8a8")
        direct("bf16", dual, 8, 16, dict(g.direct_config(dual, "fp8_w8a8"), swap_ab=True), scheme="fp8_w8a8")
        # int4 at one token: the GEMV mainloop (fused_moe_gemv.py)
        direct("bf16", dual, 8, 16, dict(g.direct_config(dual, "int4_awq"), gemv=True), scheme="int4_awq",
               combine=not dual)
    sig = {"y_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*fp32", "D": "i32", "stride_y": "i32",
           "stride_s": "i32", "stride_o": "i32", "SLOTS": "constexpr", "HAS_SHARED": "constexpr",
           "WEIGHTED": "constexpr", "BLOCK": "constexpr"}  # the aligned schedule's: unweighted bf16 slots
    compile_one("combine", fm._combine_kernel, sig, {"SLOTS": 8, "HAS_SHARED": True, "WEIGHTED": True, "BLOCK": 1024},
                4, 1)
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "E": "i32", "D": "i32", "stride_x": "i32",
           "stride_w": "i32", "stride_o": "i32", "BLOCK_E": "constexpr", "BLOCK_D": "constexpr"}
    compile_one("router_logits", r._router_logits_kernel, sig, {"BLOCK_E": 2, "BLOCK_D": 1024}, 4, 3)
    bt, be, bd, warps, stages = r._tiled_gemv_tile(64, 64, 2048)  # the token-tiled GEMV at V2-Lite, 64 tokens
    sig = {**sig, "T": "i32", "BLOCK_T": "constexpr", "NUM_STAGES": "constexpr"}
    compile_one("router_logits tiled", r._router_tile_kernel, {k: sig[k] for k in (
        "x_ptr", "w_ptr", "out_ptr", "T", "E", "D", "stride_x", "stride_w", "stride_o", "BLOCK_T", "BLOCK_E",
        "BLOCK_D", "NUM_STAGES")}, {"BLOCK_T": bt, "BLOCK_E": be, "BLOCK_D": bd, "NUM_STAGES": stages}, warps, stages)
    from deepinfer.backend import RouterSpec

    for label, spec, E, bias in (("v2-lite", RouterSpec(64, 6, "softmax", "greedy"), 64, None),
                                 ("v3", RouterSpec(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4,
                                                   norm_topk_prob=True), 256, True)):
        params = r._route_params(spec, E, bias)
        sig = {"x_ptr": "*bf16", "gw_ptr": "*fp32", "logits_ptr": "*fp32", "cnt_ptr": "*i32", "bias_ptr": "*fp32",
               "w_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32", "D": "i32", "stride_x": "i32", "stride_gw": "i32",
               "PER": "i32", "scale": "fp32"}
        consts = {k: v for k, v in params.items() if k not in ("PER", "scale")}
        consts.update(BLOCK_E=2, BLOCK_D=1024)
        sig.update({k: "constexpr" for k in consts})
        compile_one(f"gate_route {label}", r._gate_route_kernel, sig, consts, 4, 3)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET")
    main()
