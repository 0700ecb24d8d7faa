// MoE routing kernels for DeepSeek models: grouped top-k router and expert-sorted block alignment.
//
// Plain pointers and a stream only (no torch headers), so this file also builds
// and can be checked with nvcc alone; bindings.cpp adapts torch tensors.
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "moe_kernels.h"

namespace deepinfer {

constexpr int kWarp = 32;
constexpr int kMaxPerLane = 8;  // experts per lane: up to 256 experts per token

struct Best {
  float v;
  int i;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  // Larger value wins; ties go to the lower index (as a stable descending sort).
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

__device__ __forceinline__ Best warp_argmax(Best x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    Best o{__shfl_xor_sync(0xffffffffu, x.v, off), __shfl_xor_sync(0xffffffffu, x.i, off)};
    x = better(x, o);
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// One warp per token. Expert e lives in lane e % 32, register slot e / 32.
__global__ void grouped_topk_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                    float* __restrict__ out_w, int64_t* __restrict__ out_ids, int num_tokens,
                                    int num_experts, int n_group, int topk_group, int top_k, int scoring,
                                    int grouping, bool norm, float scale) {
  const int lane = threadIdx.x % kWarp;
  const int token = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (token >= num_tokens) return;
  const float* row = logits + static_cast<int64_t>(token) * num_experts;

  float score[kMaxPerLane];
  float sel[kMaxPerLane];
  float mx = -CUDART_INF_F;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int e = j * kWarp + lane;
    score[j] = e < num_experts ? row[e] : -CUDART_INF_F;
    mx = fmaxf(mx, score[j]);
  }
  if (scoring == 0) {  // softmax
    mx = warp_argmax(Best{mx, 0}).v;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      score[j] = (j * kWarp + lane) < num_experts ? expf(score[j] - mx) : 0.f;
      sum += score[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) score[j] /= sum;
  } else {  // sigmoid
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
      score[j] = (j * kWarp + lane) < num_experts ? 1.f / (1.f + expf(-score[j])) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int e = j * kWarp + lane;
    sel[j] = e < num_experts ? score[j] + (bias ? bias[e] : 0.f) : -CUDART_INF_F;
  }

  if (grouping != 0 && n_group > 1) {
    const int per = num_experts / n_group;
    float my_group_score = -CUDART_INF_F;  // lane g holds group g's score
    for (int g = 0; g < n_group; ++g) {
      Best b1{-CUDART_INF_F, 1 << 30};
#pragma unroll
      for (int j = 0; j < kMaxPerLane; ++j) {
        const int e = j * kWarp + lane;
        if (e < num_experts && e / per == g) b1 = better(b1, Best{sel[j], e});
      }
      b1 = warp_argmax(b1);
      float gs = b1.v;
      if (grouping == 2) {  // sum of the two best (V3 noaux_tc)
        Best b2{-CUDART_INF_F, 1 << 30};
#pragma unroll
        for (int j = 0; j < kMaxPerLane; ++j) {
          const int e = j * kWarp + lane;
          if (e < num_experts && e / per == g && e != b1.i) b2 = better(b2, Best{sel[j], e});
        }
        gs += warp_argmax(b2).v;
      }
      if (lane == g) my_group_score = gs;
    }
    unsigned keep = 0;
    for (int k = 0; k < topk_group; ++k) {
      const bool taken = lane < n_group && ((keep >> lane) & 1u);
      Best b = warp_argmax(Best{(lane < n_group && !taken) ? my_group_score : -CUDART_INF_F, lane});
      keep |= 1u << b.i;
    }
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int e = j * kWarp + lane;
      if (e < num_experts && !((keep >> (e / per)) & 1u)) sel[j] = -CUDART_INF_F;
    }
  }

  float w_sum = 0.f;
  float my_w = 0.f;
  int64_t my_id = 0;
  for (int k = 0; k < top_k; ++k) {
    Best b{-CUDART_INF_F, 1 << 30};
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) b = better(b, Best{sel[j], j * kWarp + lane});
    b = warp_argmax(b);
    const int owner = b.i % kWarp, slot = b.i / kWarp;
    float w = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
      if (lane == owner && j == slot) {
        w = score[j];
        sel[j] = -CUDART_INF_F;
      }
    w = __shfl_sync(0xffffffffu, w, owner);
    w_sum += w;
    if (lane == k) {
      my_w = w;
      my_id = b.i;
    }
  }
  if (lane < top_k) {
    float w = norm ? my_w / (w_sum + 1e-20f) : my_w;
    out_w[static_cast<int64_t>(token) * top_k + lane] = w * scale;
    out_ids[static_cast<int64_t>(token) * top_k + lane] = my_id;
  }
}

// One block. counts -> padded offsets -> scatter (pairs keep no particular order
// inside an expert's run: every pair's GEMM row is independent of its neighbours).
__global__ void moe_align_kernel(const int64_t* __restrict__ topk_ids, int num_pairs, int num_experts,
                                 int block_m, int max_padded, int32_t* __restrict__ sorted_ids,
                                 int32_t* __restrict__ expert_ids, int32_t* __restrict__ total_out) {
  extern __shared__ int32_t smem[];
  int32_t* counts = smem;                   // [E]
  int32_t* offsets = smem + num_experts;    // [E + 1] padded starts
  int32_t* cursor = offsets + num_experts + 1;  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) atomicAdd(&counts[topk_ids[p]], 1);
  for (int p = threadIdx.x; p < max_padded; p += blockDim.x) sorted_ids[p] = num_pairs;
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int e = 0; e < num_experts; ++e) {
      offsets[e] = acc;
      acc += (counts[e] + block_m - 1) / block_m * block_m;
    }
    offsets[num_experts] = acc;
    *total_out = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cursor[e] = offsets[e];
  const int num_blocks = max_padded / block_m;
  for (int b = threadIdx.x; b < num_blocks; b += blockDim.x) expert_ids[b] = -1;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    for (int b = offsets[e] / block_m; b < offsets[e + 1] / block_m; ++b) expert_ids[b] = e;
  for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
    const int e = static_cast<int>(topk_ids[p]);
    sorted_ids[atomicAdd(&cursor[e], 1)] = p;
  }
}

cudaError_t launch_grouped_topk(const float* logits, const float* bias, float* out_w, int64_t* out_ids,
                                int num_tokens, int num_experts, int n_group, int topk_group, int top_k,
                                int scoring, int grouping, bool norm, float scale, cudaStream_t stream) {
  if (num_experts > kWarp * kMaxPerLane || top_k > kWarp || n_group > kWarp) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const int warps = 4;
  const int blocks = (num_tokens + warps - 1) / warps;
  grouped_topk_kernel<<<blocks, warps * kWarp, 0, stream>>>(logits, bias, out_w, out_ids, num_tokens,
                                                            num_experts, n_group, topk_group, top_k, scoring,
                                                            grouping, norm, scale);
  return cudaGetLastError();
}

cudaError_t launch_moe_align(const int64_t* topk_ids, int num_pairs, int num_experts, int block_m, int max_padded,
                             int32_t* sorted_ids, int32_t* expert_ids, int32_t* total, cudaStream_t stream) {
  const size_t smem = sizeof(int32_t) * (3 * num_experts + 1);
  moe_align_kernel<<<1, 1024, smem, stream>>>(topk_ids, num_pairs, num_experts, block_m, max_padded, sorted_ids,
                                              expert_ids, total);
  return cudaGetLastError();
}

}  // namespace deepinfer
