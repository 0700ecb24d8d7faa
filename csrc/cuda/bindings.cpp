// pybind11 bindings (through torch's extension API) of the CUDA C++ MoE routing kernels.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "moe_kernels.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

std::vector<torch::Tensor> grouped_topk(torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t top_k,
                                        int64_t n_group, int64_t topk_group, int64_t scoring, int64_t grouping,
                                        bool norm, double scale) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "grouped_topk: logits must be a 2-D CUDA tensor");
  auto x = logits.to(torch::kFloat32).contiguous();
  const auto T = x.size(0), E = x.size(1);
  TORCH_CHECK(E <= 256, "grouped_topk: at most 256 experts, got ", E);
  TORCH_CHECK(top_k >= 1 && top_k <= 32 && n_group >= 1 && n_group <= 32 && E % n_group == 0,
              "grouped_topk: bad top_k / n_group");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == E, "grouped_topk: bias has ", b.numel(), " entries for ", E, " experts");
  }
  auto w = torch::empty({T, top_k}, x.options());
  auto ids = torch::empty({T, top_k}, x.options().dtype(torch::kInt64));
  check_cuda(deepinfer::launch_grouped_topk(x.data_ptr<float>(), bias.has_value() ? b.data_ptr<float>() : nullptr,
                                            w.data_ptr<float>(), ids.data_ptr<int64_t>(), T, E, n_group, topk_group,
                                            top_k, scoring, grouping, norm, static_cast<float>(scale),
                                            c10::cuda::getCurrentCUDAStream()),
             "grouped_topk launch");
  return {w, ids};
}

std::vector<torch::Tensor> moe_align(torch::Tensor topk_ids, int64_t num_experts, int64_t block_m) {
  TORCH_CHECK(topk_ids.is_cuda(), "moe_align: topk_ids must be on the GPU");
  auto ids = topk_ids.to(torch::kInt64).contiguous().view(-1);
  const int64_t n = ids.numel();
  const int64_t max_padded = n + num_experts * (block_m - 1);
  auto opts = ids.options().dtype(torch::kInt32);
  auto sorted = torch::empty({max_padded}, opts);
  auto experts = torch::empty({max_padded / block_m}, opts);
  auto total = torch::empty({1}, opts);
  check_cuda(deepinfer::launch_moe_align(ids.data_ptr<int64_t>(), n, num_experts, block_m, max_padded,
                                         sorted.data_ptr<int32_t>(), experts.data_ptr<int32_t>(),
                                         total.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()),
             "moe_align launch");
  return {sorted, experts, total};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DeepInfer CUDA C++ kernels: MoE grouped top-k router and expert block alignment";
  m.def("grouped_topk", &grouped_topk, "DeepSeek router: (weights [T,k] fp32, ids [T,k] int64)");
  m.def("moe_align", &moe_align, "expert-sorted, block-padded (sorted_ids, expert_ids, total)");
}
