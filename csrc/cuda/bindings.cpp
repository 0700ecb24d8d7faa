// pybind11 bindings (through torch's extension API) of the CUDA C++ MoE routing kernels.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "int4_gemv.h"
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

// int4 weight-only GEMVs (int4_gemv.cu). The weight layout is quant/int4_gemm.py's row layout; the launchers
// take element strides, so transposed scale / zero views (the dense linears' [N, K/G] of a [K/G, N] tensor) pass.
deepinfer::Int4Weight int4_weight(const torch::Tensor& w, const torch::Tensor& zeros, const torch::Tensor& scales,
                                  int64_t k, const char* what) {
  const bool experts = w.dim() == 3;
  TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kUInt8 && (w.dim() == 2 || experts) && w.stride(-1) == 1,
              what, ": the weight must be CUDA uint8 [(E,) rows, K/2] with contiguous rows");
  TORCH_CHECK(w.stride(-2) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, what,
              ": weight rows must start 16-byte aligned");
  TORCH_CHECK(zeros.device() == w.device() && scales.device() == w.device(), what,
              ": zeros and scales must be on the weight's device");
  TORCH_CHECK(zeros.scalar_type() == torch::kUInt8 && zeros.sizes() == scales.sizes() &&
                  zeros.strides() == scales.strides() && scales.dim() == w.dim(),
              what, ": zeros must be uint8 laid out as the scales");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf || scales.scalar_type() == torch::kFloat, what,
              ": scales must be fp16 or fp32, got ", scales.scalar_type());
  TORCH_CHECK(k % 128 == 0 && w.size(-1) * 2 == k && scales.size(-1) == k / 128 && scales.size(-2) == w.size(-2),
              what, ": K ", k, " must be a multiple of 128 with one scale a row per 128 channels");
  deepinfer::Int4Weight out{};
  out.w = w.data_ptr<uint8_t>();
  out.z = zeros.data_ptr<uint8_t>();
  out.s = scales.data_ptr();
  out.stride_we = experts ? w.stride(0) : 0;
  out.stride_wn = w.stride(-2);
  out.stride_qe = experts ? scales.stride(0) : 0;
  out.stride_qn = scales.stride(-2);
  out.stride_qk = scales.stride(-1);
  out.scale_kind = scales.scalar_type() == torch::kFloat ? 1 : 0;
  return out;
}

int act_kind(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf, what,
              ": activations must be bf16 or fp16, got ", x.scalar_type());
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              what, ": activations must be a CUDA [rows, K] tensor with 16-byte aligned rows");
  return x.scalar_type() == torch::kBFloat16 ? 0 : 1;
}

torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor zeros, torch::Tensor scales,
                        c10::optional<torch::Tensor> bias, int64_t warps) {
  const int kind = act_kind(x, "int4_gemv");
  TORCH_CHECK(warps == 4 || warps == 8, "int4_gemv: warps a tile must be 4 or 8, got ", warps);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(m >= 1 && m <= 8, "int4_gemv: 1 to 8 tokens, got ", m);
  auto w = int4_weight(qweight, zeros, scales, k, "int4_gemv");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n && bias->is_contiguous(),
                "int4_gemv: bias must be contiguous [N] in the activation dtype");
  }
  auto out = torch::empty({m, n}, x.options());
  check_cuda(deepinfer::launch_int4_gemv(x.data_ptr(), x.stride(0), m, w, bias.has_value() ? bias->data_ptr() : nullptr,
                                         out.data_ptr(), out.stride(0), n, k, kind, static_cast<int>(warps),
                                         c10::cuda::getCurrentCUDAStream()),
             "int4_gemv launch");
  return out;
}

void check_routing(const torch::Tensor& ids, int64_t num_shared, int64_t experts, const char* what) {
  TORCH_CHECK(ids.is_cuda() && ids.scalar_type() == torch::kInt64 && ids.dim() == 2 && ids.size(0) == 1 &&
                  ids.is_contiguous(),
              what, ": topk_ids must be contiguous int64 [1, top_k] (one token)");
  TORCH_CHECK(num_shared >= 0 && ids.size(1) + num_shared <= 16 && num_shared < experts, what,
              ": at most 16 slots (top_k + shared experts)");
}

torch::Tensor int4_moe_gate_up(torch::Tensor x, torch::Tensor w13, torch::Tensor zeros, torch::Tensor scales,
                               torch::Tensor ids, int64_t num_shared, int64_t split,
                               std::optional<torch::Tensor> perm) {
  const int kind = act_kind(x, "int4_moe_gate_up");
  TORCH_CHECK(x.size(0) == 1, "int4_moe_gate_up: one token, got ", x.size(0));
  TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0, "int4_moe_gate_up: w13 must be [E, 2I, K/2]");
  check_routing(ids, num_shared, w13.size(0), "int4_moe_gate_up");
  const int64_t k = x.size(1), inter = w13.size(1) / 2, top_k = ids.size(1);
  auto w = int4_weight(w13, zeros, scales, k, "int4_moe_gate_up");
  if (perm.has_value()) {  // act-order experts' sorted columns: int32 [routed experts, K], x gathered through it
    TORCH_CHECK(perm->is_cuda() && perm->scalar_type() == torch::kInt32 && perm->dim() == 2 &&
                    perm->size(0) == w13.size(0) - num_shared && perm->size(1) == k && perm->is_contiguous(),
                "int4_moe_gate_up: perm must be contiguous int32 [routed experts, K]");
  }
  auto act = torch::empty({top_k + num_shared, inter}, x.options());
  check_cuda(deepinfer::launch_int4_moe_gate_up(x.data_ptr(), w, ids.data_ptr<int64_t>(), top_k, num_shared,
                                                w13.size(0) - num_shared, act.data_ptr(), act.stride(0), inter, k,
                                                kind, static_cast<int>(split),
                                                perm.has_value() ? perm->data_ptr<int32_t>() : nullptr,
                                                c10::cuda::getCurrentCUDAStream()),
             "int4_moe_gate_up launch");
  return act;
}

torch::Tensor int4_moe_down(torch::Tensor act, torch::Tensor w2, torch::Tensor zeros, torch::Tensor scales,
                            torch::Tensor ids, torch::Tensor weights, int64_t num_shared, int64_t split) {
  const int kind = act_kind(act, "int4_moe_down");
  TORCH_CHECK(w2.dim() == 3, "int4_moe_down: w2 must be [E, D, I/2]");
  check_routing(ids, num_shared, w2.size(0), "int4_moe_down");
  const int64_t top_k = ids.size(1), k = act.size(1), d = w2.size(1);
  TORCH_CHECK(act.size(0) == top_k + num_shared, "int4_moe_down: act has ", act.size(0), " rows for ",
              top_k + num_shared, " slots");
  TORCH_CHECK(weights.is_cuda() && weights.scalar_type() == torch::kFloat && weights.is_contiguous() &&
                  weights.numel() == top_k,
              "int4_moe_down: topk_weights must be contiguous fp32 [1, top_k]");
  auto w = int4_weight(w2, zeros, scales, k, "int4_moe_down");
  auto out = torch::empty({1, d}, act.options());
  check_cuda(deepinfer::launch_int4_moe_down(act.data_ptr(), act.stride(0), w, ids.data_ptr<int64_t>(),
                                             weights.data_ptr<float>(), top_k, num_shared, w2.size(0) - num_shared,
                                             out.data_ptr(), d, k, kind, static_cast<int>(split),
                                             c10::cuda::getCurrentCUDAStream()),
             "int4_moe_down launch");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DeepInfer CUDA C++ kernels: MoE router, expert block alignment, int4 GEMVs";
  m.def("grouped_topk", &grouped_topk, "DeepSeek router: (weights [T,k] fp32, ids [T,k] int64)");
  m.def("moe_align", &moe_align, "expert-sorted, block-padded (sorted_ids, expert_ids, total)");
  m.def("int4_gemv", &int4_gemv, "int4 weight-only GEMV, 1-8 tokens, group 128: [M, N]");
  m.def("int4_moe_gate_up", &int4_moe_gate_up, "one token's int4 experts: silu(gate) * up [slots, I]", py::arg("x"),
        py::arg("w13"), py::arg("zeros"), py::arg("scales"), py::arg("ids"), py::arg("num_shared"), py::arg("split"),
        py::arg("perm") = py::none());
  m.def("int4_moe_down", &int4_moe_down, "one token's int4 experts: down + weighted slot sum [1, D]");
}
