// Launchers of the int4 weight-only GEMV kernels (see int4_gemv.cu).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace deepinfer {

// The int4 row layout shared with the Triton kernels (quant/int4_gemm.py): weight uint8 [rows, K/2] (two input
// channels a byte, the low nibble the even one), zero points uint8 and scales (fp16 or fp32) [rows, K/128] with
// element strides (stride_qn, stride_qk), W = (q - z) * s. act: 0 bf16, 1 fp16; scale: 0 fp16, 1 fp32.
struct Int4Weight {
  const uint8_t* w;
  const uint8_t* z;
  const void* s;
  int64_t stride_we;  // bytes between experts (MoE) or 0
  int64_t stride_wn;  // bytes between rows
  int64_t stride_qe;  // scale / zero elements between experts
  int64_t stride_qn;  // ... between rows
  int64_t stride_qk;  // ... between groups
  int scale_kind;     // 0 fp16, 1 fp32
};

// out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for m < M <= 8; K a multiple of 128. warps: 4 or 8 a 16-row tile
// (DEEPINFER_INT4_CUDA_DENSE_WARPS).
cudaError_t launch_int4_gemv(const void* x, int64_t stride_x, int m, Int4Weight w, const void* bias, void* out,
                             int64_t stride_o, int n, int k, int act, int warps, cudaStream_t stream);

// One token's routed (and stacked shared) experts, gate_up: act[s, i] = silu(gate) * up for slot s < top_k +
// num_shared (slot s < top_k takes expert ids[s], else num_routed + s - top_k); w rows [0, inter) the gate,
// [inter, 2 inter) the up projection.
// split: 1, 2, 4 or 8 (each tile's groups over that many warps; DEEPINFER_INT4_CUDA_SPLIT_K).
cudaError_t launch_int4_moe_gate_up(const void* x, Int4Weight w, const int64_t* ids, int top_k, int num_shared,
                                    int num_routed, void* act, int64_t stride_act, int inter, int k, int act_kind,
                                    int split, const int32_t* perm, cudaStream_t stream);

// ... down with the combine: out[d] = sum over slots (in slot order, fp32) of round(W_e[d] . act[s]) * weight[s]
// (shared slots weight 1.0), rounded once to the activation dtype.
cudaError_t launch_int4_moe_down(const void* act, int64_t stride_act, Int4Weight w, const int64_t* ids,
                                 const float* weights, int top_k, int num_shared, int num_routed, void* out, int d,
                                 int k, int act_kind, int split, cudaStream_t stream);

}  // namespace deepinfer
