// Launchers of the CUDA C++ MoE routing kernels (see moe_kernels.cu).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace deepinfer {

// scoring: 0 softmax, 1 sigmoid. grouping: 0 none, 1 group max (V2), 2 group top-2 sum (V3 noaux_tc).
cudaError_t launch_grouped_topk(const float* logits, const float* bias, float* out_w, int64_t* out_ids,
                                int num_tokens, int num_experts, int n_group, int topk_group, int top_k,
                                int scoring, int grouping, bool norm, float scale, cudaStream_t stream);

cudaError_t launch_moe_align(const int64_t* topk_ids, int num_pairs, int num_experts, int block_m, int max_padded,
                             int32_t* sorted_ids, int32_t* expert_ids, int32_t* total, cudaStream_t stream);

}  // namespace deepinfer
