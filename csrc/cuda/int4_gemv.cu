// int4 weight-only GEMV for decode (up to 8 tokens) and one token's routed experts, converting two weights an
// instruction.
//
// Why: the Triton int4 kernels dequantize each weight in fp32 (nibble, 2^23 offset, zero point, scale: about five
// instructions a weight) and ran at ~1 TB/s of int4 weight at one token, bound by that ALU work, not by DRAM
// (docs/quantization.md, "Where int4 at one token loses"). Here a 32-bit word of eight nibbles becomes four packed
// 16-bit pairs with one LOP3 each (the nibble OR-ed into the mantissa of 128.0 in bf16 / 1024.0 in fp16, whose
// ulp is 1), one packed subtraction of (magic + zero point) each, exact, and the tensor cores take the pairs as
// mma.m16n8k16's A operand with fp32 accumulation; the group's scale multiplies the fp32 partial sums once per
// group. Arithmetic: sum over groups of s * sum_k (q - z) x_k in fp32, as quant/tiles.py int4_row_dot (the
// weight is not rounded to the activation dtype first).
//
// Fragment mapping (PTX ISA, mma.m16n8k16 with .bf16 / .f16 operands; lane = 4 g + t):
//   A (16 x 16, row): a0 = row g, k (2t, 2t+1); a1 = row g+8, same k; a2 = row g, k (2t+8, 2t+9); a3 = row g+8.
//   B (16 x 8, col):  b0 = column g, k (2t, 2t+1); b1 = column g, k (2t+8, 2t+9).
//   C (16 x 8, fp32): c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g+8.
// An A row is a weight row (16 a warp), a B column a token (up to 8): every A register is a converted weight pair,
// so no operand register holds a padding zero (a first version, tokens in A and 8 weight rows in B, spent a third
// of its instructions moving zeros into the A quads and ran two MMAs per 16 x 16 weights instead of one). The word
// of lane t holds channels c..c+7 (byte i: channels 2i in the low nibble, 2i+1 in the high one), and
// LOP3(word >> 4j, 0x000F000F, magic) yields the pair (c_j, c_j+4). A product sums over k, so any bijection of one
// mma's 16 k onto channels serves when A and B share it: mma 0 of a word takes (2t, 2t+1) = (c0, c4) and
// (2t+8, 2t+9) = (c1, c5), mma 1 (c2, c6) and (c3, c7); the activations are paired to match with one byte
// permute a pair.
// Tile: a warp computes 16 weight rows (rows g and g + 8 of lane g's) for up to 8 tokens; lane t loads 16 bytes
// (32 channels) of each of its two rows per 128-channel group, so the 4 lanes of a row cover exactly one group
// and one zero point and one scale a row apply to each mma's whole k. Where a block's warps split the groups
// they add their partial sums in warp order (deterministic). Each warp issues its first groups' weight loads,
// then the block stages the activation rows in shared memory (read per group from there: reading them from
// global memory inside the conversion loop made a chain of dependent L2 trips).
//
// Plain pointers and a stream only (no torch headers), as moe_kernels.cu; bindings.cpp adapts torch tensors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "int4_gemv.h"

namespace deepinfer {
namespace {

constexpr int kGroup = 128;     // input channels a scale / zero point covers (the only group size taken)
constexpr int kUnroll = 4;      // groups whose loads a warp issues before it converts the first
constexpr int kMaxSlots = 16;   // MoE slots (top_k + shared experts) a down block sums
constexpr int kDenseWarps = 4;  // warps splitting K in the dense and gate_up blocks
constexpr int kGateUpUnroll = 2;  // groups a gate_up batch holds (two batches in flight: run_pipelined)
// groups a down batch holds: two rows a lane, so 6 keeps the 512-thread block within 128 registers without spills
constexpr int kDownUnroll = 6;
// groups a down batch holds at split 4 (a 1024-thread block: 64 registers a thread): V2-Lite's 11 groups over 4 warps
constexpr int kDownUnroll4 = 3;

template <typename T>
struct Magic;
template <>
struct Magic<__nv_bfloat16> {
  static constexpr uint32_t kBits = 0x4300u;  // 128.0: 128 + q exact for q < 128
};
template <>
struct Magic<__half> {
  static constexpr uint32_t kBits = 0x6400u;  // 1024.0
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// (magic | nibble 0 of w's low half, magic | nibble 0 of its high half): two weights + magic, one instruction
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, uint32_t magic2) {
  uint32_t r;
  const uint32_t mask = 0x000F000Fu;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(magic2));  // (w & mask) | magic2
  return r;
}

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t sub2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <>
__device__ __forceinline__ uint32_t sub2<__half>(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

// kUnroll groups' weights (the lane's two rows), zero points and scales, loaded before any is converted
template <int kHalves, int kUnroll>
struct Batch {
  uint4 wv[kHalves][2][kUnroll];
  uint32_t zz[kHalves][2][kUnroll];
  float sc[kHalves][2][kUnroll];
};

// The per-lane addressing of one warp's 16-row weight tile: rows [row0, row0 + 16) of `rows` (and, kHalves 2, the
// same rows `up_rows` further: the up projection beside the gate). Lane (g, t) loads rows row0 + g and
// row0 + g + 8: 16 bytes at 16 t of each group's 64, their zero points and their scales (its C rows too).
template <typename T, typename S, int kHalves>
struct WarpTile {
  // pointers at group 0; rows past the end are clamped to the last one (loaded, never stored), so no load is
  // predicated
  // one base pointer each (the expert's, the lane's 16 bytes for weights) and 32-bit offsets a row within the
  // expert: fewer registers than a pointer a row (the 1024-thread down blocks of split 8 hold 64 a thread)
  const uint8_t* wb;
  const uint8_t* zb;
  const S* sb;
  uint32_t wo[kHalves][2];  // bytes
  uint32_t qo[kHalves][2];  // zero-point / scale elements
  int qk;  // scale / zero elements between groups

  __device__ __forceinline__ WarpTile(const Int4Weight& w, int64_t w_off, int64_t q_off, int row0, int rows,
                                      int up_rows)
      : wb(w.w + w_off + (threadIdx.x & 3) * 16), zb(w.z + q_off), sb(static_cast<const S*>(w.s) + q_off),
        qk(static_cast<int>(w.stride_qk)) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = static_cast<int64_t>(h) * up_rows + min(row0 + g + 8 * r, rows - 1);
        wo[h][r] = static_cast<uint32_t>(row * w.stride_wn);
        qo[h][r] = static_cast<uint32_t>(row * w.stride_qn);
      }
    }
  }

  // groups base, base + step, ... (kUnroll of them; one past the end reloads the last group, never used)
  template <int kUnroll>
  __device__ __forceinline__ void load(Batch<kHalves, kUnroll>& b, int base, int end, int step) const {
    const uint32_t magic = Magic<T>::kBits;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int grp = min(base + u * step, end - 1);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          b.wv[h][r][u] = __ldg(reinterpret_cast<const uint4*>(wb + wo[h][r] + static_cast<uint32_t>(grp * (kGroup / 2))));
          const uint32_t q = qo[h][r] + static_cast<uint32_t>(grp * qk);
          b.zz[h][r][u] = (magic | static_cast<uint32_t>(zb[q])) * 0x00010001u;  // magic + z, twice
          b.sc[h][r][u] = to_float(sb[q]);
        }
      }
    }
  }

  // acc[h][i] += the batch's groups against tokens [0, m) of xs (shared memory, row stride stride_s elements):
  // c_i of half h (row g, tokens 2t / 2t+1 for i 0 / 1; row g + 8 for i 2 / 3), scaled per group and row.
  template <int kUnroll>
  __device__ __forceinline__ void compute(const Batch<kHalves, kUnroll>& b, int base, int end, int step,
                                          const T* xs, int stride_s, int m, float (&acc)[2][4]) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool tok = g < m;  // lane (g, t) supplies token g's activations (B column g)
    const T* xrow = xs + g * stride_s + t * 32;
    const uint32_t magic = Magic<T>::kBits, magic2 = magic | (magic << 16);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int grp = base + u * step;
      if (grp >= end) break;
      float c[kHalves][4];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) c[h][0] = c[h][1] = c[h][2] = c[h][3] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // (x0,x1), (x2,x3), (x4,x5), (x6,x7) of the token's 8 channels c..c+7 of this word
        const uint4 xv = tok ? *reinterpret_cast<const uint4*>(xrow + grp * kGroup + 8 * j) : make_uint4(0, 0, 0, 0);
        const uint32_t b_lo0 = __byte_perm(xv.x, xv.z, 0x5410), b_lo1 = __byte_perm(xv.x, xv.z, 0x7632);
        const uint32_t b_hi0 = __byte_perm(xv.y, xv.w, 0x5410), b_hi1 = __byte_perm(xv.y, xv.w, 0x7632);
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          const uint32_t qa = word(b.wv[h][0][u], j), qb = word(b.wv[h][1][u], j);
          const uint32_t za = b.zz[h][0][u], zb = b.zz[h][1][u];
          const uint32_t a_lo[4] = {sub2<T>(nibble_pair(qa, magic2), za), sub2<T>(nibble_pair(qb, magic2), zb),
                                    sub2<T>(nibble_pair(qa >> 4, magic2), za),
                                    sub2<T>(nibble_pair(qb >> 4, magic2), zb)};
          mma<T>(c[h], a_lo, b_lo0, b_lo1);
          const uint32_t a_hi[4] = {sub2<T>(nibble_pair(qa >> 8, magic2), za),
                                    sub2<T>(nibble_pair(qb >> 8, magic2), zb),
                                    sub2<T>(nibble_pair(qa >> 12, magic2), za),
                                    sub2<T>(nibble_pair(qb >> 12, magic2), zb)};
          mma<T>(c[h], a_hi, b_hi0, b_hi1);
        }
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        acc[h][0] += c[h][0] * b.sc[h][0][u];
        acc[h][1] += c[h][1] * b.sc[h][0][u];
        acc[h][2] += c[h][2] * b.sc[h][1][u];
        acc[h][3] += c[h][3] * b.sc[h][1][u];
      }
    }
  }

  // As run, with two batches in registers: the next batch's loads are in flight while one is converted (a warp
  // that owns a whole K loop; run's single batch suits warps splitting a short K).
  template <int kUnroll, typename Stage>
  __device__ __forceinline__ void run_pipelined(int begin, int end, int step, Stage stage, const T* xs,
                                                int stride_s, int m, float (&acc)[2][4]) const {
    Batch<kHalves, kUnroll> b0, b1;
    const int span = kUnroll * step;
    load(b0, begin, end, step);
    stage();
    __syncthreads();
    for (int base = begin; base < end; base += 2 * span) {
      load(b1, base + span, end, step);  // a group past the end reloads the last one (never used)
      compute(b0, base, end, step, xs, stride_s, m, acc);
      if (base + 2 * span < end) load(b0, base + 2 * span, end, step);
      compute(b1, base + span, end, step, xs, stride_s, m, acc);
    }
  }

  // The whole reduction over groups begin, begin + step, ... < end: the first batch's loads go out before the
  // activations are staged into shared memory (stage() then __syncthreads(), by every thread of the block).
  // kOnce: the caller guarantees one batch covers the warp's groups (end - begin <= kUnroll x step): no loop
  template <int kUnroll, typename Stage, bool kOnce = false>
  __device__ __forceinline__ void run(int begin, int end, int step, Stage stage, const T* xs, int stride_s, int m,
                                      float (&acc)[2][4]) const {
    Batch<kHalves, kUnroll> b;
    load(b, begin, end, step);
    stage();
    __syncthreads();
    if (kOnce) {
      compute(b, begin, end, step, xs, stride_s, m, acc);
      return;
    }
    for (int base = begin; base < end; base += kUnroll * step) {
      if (base != begin) load(b, base, end, step);
      compute(b, base, end, step, xs, stride_s, m, acc);
    }
  }
};

// rows [0, m) of x (row stride stride_x) into shared memory at row stride stride_s = k + 8 elements: the 16-byte
// pad puts the same channel of consecutive rows 4 banks apart, so the 8 row groups of a warp do not collide
template <typename T>
__device__ __forceinline__ void stage_rows(const T* __restrict__ x, int64_t stride_x, int m, int k, T* xs,
                                           int stride_s) {
  const int per_row = k / 8;
  for (int i = threadIdx.x; i < m * per_row; i += blockDim.x) {
    const int r = i / per_row, c = i - r * per_row;
    *reinterpret_cast<uint4*>(xs + r * stride_s + 8 * c) =
        __ldg(reinterpret_cast<const uint4*>(x + r * stride_x + 8 * c));
  }
}

// x's channels in the order perm gives (k int32 indices: staged channel j = x[perm[j]]) into shared memory: a GPTQ
// act-order expert whose weight columns were sorted by group at load (backends/nvidia/quant/act_order.py)
// Eight channels a thread a step: two 16-byte loads of perm, eight independent loads of x (from L1 / L2: x is 4 KB
// at K 2048), one 16-byte store (perm's rows are K int32 from a 16-byte aligned base, K a multiple of 128).
template <typename T>
__device__ __forceinline__ void stage_permuted(const T* __restrict__ x, const int32_t* __restrict__ perm, int k,
                                               T* xs) {
  const int4* p = reinterpret_cast<const int4*>(perm);
  for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
    const int4 a = __ldg(p + 2 * i), b = __ldg(p + 2 * i + 1);
    alignas(16) T v[8] = {x[a.x], x[a.y], x[a.z], x[a.w], x[b.x], x[b.y], x[b.z], x[b.w]};
    *reinterpret_cast<uint4*>(xs + 8 * i) = *reinterpret_cast<const uint4*>(v);
  }
}

// Warps w = part x kTiles + tile split one tile's groups kSplit ways; the part-0 warp of each tile ends with the
// sum of its parts' acc, added in part order (deterministic). red: kTiles x kSplit x kHalves x 4 x 32 floats.
template <int kTiles, int kSplit, int kHalves>
__device__ __forceinline__ void split_sum(float (&acc)[2][4], float* red) {
  if (kSplit == 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= kTiles) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[((warp * kHalves + h) * 4 + i) * 32 + lane] = acc[h][i];
  }
  __syncthreads();
  if (warp < kTiles) {
    for (int part = 1; part < kSplit; ++part) {
      const int v = part * kTiles + warp;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][i] += red[((v * kHalves + h) * 4 + i) * 32 + lane];
    }
  }
}

template <typename T, typename S, int kWarps, int kBatch = kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    int4_gemv_kernel(const T* __restrict__ x, int64_t stride_x, int m, Int4Weight w, const T* __restrict__ bias,
                     T* __restrict__ out, int64_t stride_o, int n, int groups) {
  extern __shared__ uint4 smem[];
  __shared__ float red[kWarps * 4 * 32];
  T* xs = reinterpret_cast<T*>(smem);
  const int row0 = blockIdx.x * 16, k = groups * kGroup, stride_s = k + 8;
  float acc[2][4] = {};
  const WarpTile<T, S, 1> tile(w, 0, 0, row0, n, 0);
  tile.template run<kBatch>(threadIdx.x >> 5, groups, kWarps, [&] { stage_rows(x, stride_x, m, k, xs, stride_s); },
                            xs, stride_s, m, acc);
  split_sum<1, kWarps, 1>(acc, red);
  if (threadIdx.x < 32) {
    const int g = threadIdx.x >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int token = 2 * t + (i & 1), row = row0 + g + (i >= 2 ? 8 : 0);
      if (token < m && row < n) {
        const float b = bias != nullptr ? to_float(bias[row]) : 0.f;
        out[static_cast<int64_t>(token) * stride_o + row] = from_float<T>(acc[0][i] + b);
      }
    }
  }
}

// A block's warps take kTiles consecutive 16-row tiles of one slot's gate and up projections, each tile's groups
// split kSplit ways (1: a warp owns its tile's whole K loop, no reduction), batches pipelined, the staged x shared.
template <typename T, typename S, int kTiles, int kSplit>
__global__ void __launch_bounds__(kTiles * kSplit * 32)
    int4_moe_gate_up_kernel(const T* __restrict__ x, Int4Weight w, const int64_t* __restrict__ ids, int top_k,
                            int num_routed, T* __restrict__ act, int64_t stride_act, int inter, int groups,
                            const int32_t* __restrict__ perm) {
  extern __shared__ uint4 smem[];
  __shared__ float red[kSplit > 1 ? kTiles * kSplit * 2 * 4 * 32 : 1];
  T* xs = reinterpret_cast<T*>(smem);
  // (kSplit 1 spelled as constants: the same code as the kernel measured before the split variant existed)
  const int warp = threadIdx.x >> 5, tile = kSplit == 1 ? warp : warp % kTiles, part = kSplit == 1 ? 0 : warp / kTiles;
  const int slot = blockIdx.y, row0 = (blockIdx.x * kTiles + tile) * 16, k = groups * kGroup;
  const int64_t e = slot < top_k ? ids[slot] : static_cast<int64_t>(num_routed + slot - top_k);
  float acc[2][4] = {};
  const WarpTile<T, S, 2> wt(w, e * w.stride_we, e * w.stride_qe, row0, inter, inter);
  auto stage = [&] {  // (perm: act-order routed experts' sorted columns; shared experts keep x in order)
    if (perm != nullptr && e < num_routed) {
      stage_permuted(x, perm + e * k, k, xs);
    } else {
      stage_rows(x, 0, 1, k, xs, k + 8);
    }
  };
  if (kSplit >= 8) {  // one batch a warp (the launcher checks groups <= 8 x kGateUpUnroll; V2-Lite's 16: two each)
    wt.template run<kGateUpUnroll, decltype(stage), true>(part, groups, kSplit, stage, xs, k + 8, 1, acc);
  } else {
    wt.template run_pipelined<kGateUpUnroll>(part, groups, kSplit, stage, xs, k + 8, 1, acc);
  }
  split_sum<kTiles, kSplit, 2>(acc, red);
  const int lane = threadIdx.x & 31;
  if (part == 0 && (lane & 3) == 0) {  // token 0: lanes with t = 0 hold rows g (c0) and g + 8 (c2)
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const int row = row0 + (lane >> 2) + (i ? 8 : 0);
      if (row < inter) {  // silu(gate) * up with the native op's roundings (fused_moe_mainloop._epilogue)
        const float gate = round_to<T>(acc[0][i]), up = round_to<T>(acc[1][i]);
        const float a = round_to<T>(gate / (1.f + __expf(-gate)));
        act[slot * stride_act + row] = from_float<T>(a * up);
      }
    }
  }
}

// One warp per (slot, part): the slots' 16-row tiles of the same output rows, each slot's groups split kSplit ways
// (kSplit x slots <= kMaxSlots warps, or 2 x kMaxSlots at kSplit 4: a 1024-thread block, its registers capped at
// 64 a thread by the launch bound, each warp holding its at most kDownUnroll4 groups in one batch); then the
// slots' products, weighted, summed in slot order.
template <int kSplit>
constexpr int down_threads() {
  return kSplit >= 4 ? 2 * kMaxSlots * 32 : kMaxSlots * 32;
}
template <typename T, typename S, int kSplit>
__global__ void __launch_bounds__(down_threads<kSplit>())
    int4_moe_down_kernel(const T* __restrict__ act, int64_t stride_act, Int4Weight w, const int64_t* __restrict__ ids,
                         const float* __restrict__ weights, int top_k, int num_routed, T* __restrict__ out, int d,
                         int groups) {
  extern __shared__ uint4 smem[];
  __shared__ float part_sum[kMaxSlots][16];
  __shared__ float halves[kSplit > 1 ? kSplit - 1 : 1][kSplit > 1 ? kMaxSlots : 1][16];
  T* xs = reinterpret_cast<T*>(smem);
  const int slots = (blockDim.x >> 5) / kSplit, warp = threadIdx.x >> 5;
  const int slot = kSplit == 1 ? warp : warp % slots, part = kSplit == 1 ? 0 : warp / slots;  // (as in gate_up)
  const int lane = threadIdx.x & 31, row0 = blockIdx.x * 16;
  const int k = groups * kGroup, stride_s = k + 8;
  const int64_t e = slot < top_k ? ids[slot] : static_cast<int64_t>(num_routed + slot - top_k);
  float acc[2][4] = {};
  const WarpTile<T, S, 1> wt(w, e * w.stride_we, e * w.stride_qe, row0, d, 0);
  auto stage = [&] { stage_rows(act, stride_act, slots, k, xs, stride_s); };
  if (kSplit >= 4) {  // one batch a warp (the launcher checks groups <= 4 x kDownUnroll4): no loop registers
    wt.template run<kDownUnroll4, decltype(stage), true>(part, groups, kSplit, stage, xs + slot * stride_s, stride_s,
                                                         1, acc);
  } else {
    wt.template run<kDownUnroll>(part, groups, kSplit, stage, xs + slot * stride_s, stride_s, 1, acc);
  }
  if (kSplit > 1) {  // parts 1.. sums of token 0 (lanes t = 0: rows g, g + 8) join part 0's, in part order
    if (part > 0 && (lane & 3) == 0) {
      halves[part - 1][slot][lane >> 2] = acc[0][0];
      halves[part - 1][slot][(lane >> 2) + 8] = acc[0][2];
    }
    __syncthreads();
    if (part == 0 && (lane & 3) == 0) {
#pragma unroll
      for (int p = 0; p < kSplit - 1; ++p) {
        acc[0][0] += halves[p][slot][lane >> 2];
        acc[0][2] += halves[p][slot][(lane >> 2) + 8];
      }
    }
  }
  if (part == 0 && (lane & 3) == 0) {  // the slot's product rounded to the activation dtype, weighted in fp32
    const float wt_s = slot < top_k ? weights[slot] : 1.f;  // (fused_moe.combine)
    part_sum[slot][lane >> 2] = round_to<T>(acc[0][0]) * wt_s;
    part_sum[slot][(lane >> 2) + 8] = round_to<T>(acc[0][2]) * wt_s;
  }
  __syncthreads();
  if (threadIdx.x < 16 && row0 + static_cast<int>(threadIdx.x) < d) {
    float sum = 0.f;
    for (int s = 0; s < slots; ++s) sum += part_sum[s][threadIdx.x];  // slot order, as the combine kernel
    out[row0 + threadIdx.x] = from_float<T>(sum);
  }
}

// dynamic shared memory of `rows` staged activation rows of k channels
template <typename T>
size_t staged_bytes(int rows, int k) {
  return static_cast<size_t>(rows) * (k + 8) * sizeof(T);
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename T, typename S, int kWarps, int kBatch>
cudaError_t gemv_as(const void* x, int64_t stride_x, int m, Int4Weight w, const void* bias, void* out,
                    int64_t stride_o, int n, int k, cudaStream_t stream) {
  const size_t smem = staged_bytes<T>(m, k);
  const cudaError_t err = allow_smem(int4_gemv_kernel<T, S, kWarps, kBatch>, smem);
  if (err != cudaSuccess) return err;
  int4_gemv_kernel<T, S, kWarps, kBatch><<<(n + 15) / 16, kWarps * 32, smem, stream>>>(
      static_cast<const T*>(x), stride_x, m, w, static_cast<const T*>(bias), static_cast<T*>(out), stride_o, n,
      k / kGroup);
  return cudaGetLastError();
}

// warps 4 (kDenseWarps, kUnroll groups a batch) or 8 (two groups a batch: V2-Lite's K of 2048 is 16 groups, so
// each warp's one batch; a shorter dependent chain of conversions and MMAs a warp, twice the warps a tile)
template <typename T, typename S>
cudaError_t gemv(const void* x, int64_t stride_x, int m, Int4Weight w, const void* bias, void* out, int64_t stride_o,
                 int n, int k, int warps, cudaStream_t stream) {
  if (warps == 8) return gemv_as<T, S, 8, 2>(x, stride_x, m, w, bias, out, stride_o, n, k, stream);
  return gemv_as<T, S, kDenseWarps, kUnroll>(x, stride_x, m, w, bias, out, stride_o, n, k, stream);
}

template <typename T, typename S, int kTiles, int kSplit>
cudaError_t gate_up_as(const void* x, Int4Weight w, const int64_t* ids, int top_k, int num_shared, int num_routed,
                       void* act, int64_t stride_act, int inter, int k, const int32_t* perm, cudaStream_t stream) {
  const dim3 grid(((inter + 15) / 16 + kTiles - 1) / kTiles, top_k + num_shared);
  const size_t smem = staged_bytes<T>(1, k);
  const cudaError_t err = allow_smem(int4_moe_gate_up_kernel<T, S, kTiles, kSplit>, smem);
  if (err != cudaSuccess) return err;
  int4_moe_gate_up_kernel<T, S, kTiles, kSplit><<<grid, kTiles * kSplit * 32, smem, stream>>>(
      static_cast<const T*>(x), w, ids, top_k, num_routed, static_cast<T*>(act), stride_act, inter, k / kGroup, perm);
  return cudaGetLastError();
}

// split 1: four tiles a block, each warp a whole K loop (measured, session 29); split 2 / 4: one tile a block, its
// groups over two / four warps (two / four times the warps, so the bytes in flight a multiprocessor: at V2-Lite's
// shapes split 1 puts 704 warps on 132 multiprocessors, each with at most two 2-group batches in flight, which
// covers about half of the DRAM latency-bandwidth product; split 4 gives each warp 4 of 16 groups, all in flight
// at once; neither yet timed)
template <typename T, typename S>
cudaError_t gate_up(const void* x, Int4Weight w, const int64_t* ids, int top_k, int num_shared, int num_routed,
                    void* act, int64_t stride_act, int inter, int k, int split, const int32_t* perm,
                    cudaStream_t stream) {
  if (split == 8 && k / kGroup <= 8 * kGateUpUnroll) {  // eight warps a tile, one batch each (down: four warps)
    return gate_up_as<T, S, 1, 8>(x, w, ids, top_k, num_shared, num_routed, act, stride_act, inter, k, perm, stream);
  }
  if (split == 4) {
    return gate_up_as<T, S, 1, 4>(x, w, ids, top_k, num_shared, num_routed, act, stride_act, inter, k, perm, stream);
  }
  return split == 2 ? gate_up_as<T, S, 1, 2>(x, w, ids, top_k, num_shared, num_routed, act, stride_act, inter, k,
                                             perm, stream)
                    : gate_up_as<T, S, kDenseWarps, 1>(x, w, ids, top_k, num_shared, num_routed, act, stride_act,
                                                       inter, k, perm, stream);
}

template <typename T, typename S, int kSplit>
cudaError_t down_as(const void* act, int64_t stride_act, Int4Weight w, const int64_t* ids, const float* weights,
                    int top_k, int num_shared, int num_routed, void* out, int d, int k, cudaStream_t stream) {
  const int slots = top_k + num_shared;
  const size_t smem = staged_bytes<T>(slots, k);
  const cudaError_t err = allow_smem(int4_moe_down_kernel<T, S, kSplit>, smem);
  if (err != cudaSuccess) return err;
  int4_moe_down_kernel<T, S, kSplit><<<(d + 15) / 16, slots * kSplit * 32, smem, stream>>>(
      static_cast<const T*>(act), stride_act, w, ids, weights, top_k, num_routed, static_cast<T*>(out), d,
      k / kGroup);
  return cudaGetLastError();
}

// split 2 or 4 (at most 8 slots): each slot's groups over two warps, one batch each at V2-Lite's 11 groups; split 8
// (at most 8 slots and 12 groups: one batch a warp): over four warps, a 1024-thread block (more warps to hide the
// conversion and MMA chains: at split 2 ncu saw 4 warps a scheduler, 0.62 eligible, on an H100); else as split 2
template <typename T, typename S>
cudaError_t down(const void* act, int64_t stride_act, Int4Weight w, const int64_t* ids, const float* weights,
                 int top_k, int num_shared, int num_routed, void* out, int d, int k, int split, cudaStream_t stream) {
  if (split == 8 && 4 * (top_k + num_shared) <= 2 * kMaxSlots && k / kGroup <= 4 * kDownUnroll4) {
    return down_as<T, S, 4>(act, stride_act, w, ids, weights, top_k, num_shared, num_routed, out, d, k, stream);
  }
  if (split >= 2 && 2 * (top_k + num_shared) <= kMaxSlots) {
    return down_as<T, S, 2>(act, stride_act, w, ids, weights, top_k, num_shared, num_routed, out, d, k, stream);
  }
  return down_as<T, S, 1>(act, stride_act, w, ids, weights, top_k, num_shared, num_routed, out, d, k, stream);
}

// f(T{}, S{}) for the activation type (0 bf16, 1 fp16) and the scale type (0 fp16, 1 fp32)
template <typename F>
cudaError_t dispatch(int act_kind, int scale_kind, F f) {
  if (act_kind == 0) return scale_kind ? f(__nv_bfloat16{}, float{}) : f(__nv_bfloat16{}, __half{});
  return scale_kind ? f(__half{}, float{}) : f(__half{}, __half{});
}

}  // namespace

cudaError_t launch_int4_gemv(const void* x, int64_t stride_x, int m, Int4Weight w, const void* bias, void* out,
                             int64_t stride_o, int n, int k, int act, int warps, cudaStream_t stream) {
  if (m < 1 || m > 8 || k % kGroup != 0 || (warps != 4 && warps != 8)) return cudaErrorInvalidValue;
  return dispatch(act, w.scale_kind, [&](auto t, auto s) {
    return gemv<decltype(t), decltype(s)>(x, stride_x, m, w, bias, out, stride_o, n, k, warps, stream);
  });
}

cudaError_t launch_int4_moe_gate_up(const void* x, Int4Weight w, const int64_t* ids, int top_k, int num_shared,
                                    int num_routed, void* act, int64_t stride_act, int inter, int k, int act_kind,
                                    int split, const int32_t* perm, cudaStream_t stream) {
  if (k % kGroup != 0 || top_k + num_shared < 1) return cudaErrorInvalidValue;
  return dispatch(act_kind, w.scale_kind, [&](auto t, auto s) {
    return gate_up<decltype(t), decltype(s)>(x, w, ids, top_k, num_shared, num_routed, act, stride_act, inter, k,
                                             split, perm, stream);
  });
}

cudaError_t launch_int4_moe_down(const void* act, int64_t stride_act, Int4Weight w, const int64_t* ids,
                                 const float* weights, int top_k, int num_shared, int num_routed, void* out, int d,
                                 int k, int act_kind, int split, cudaStream_t stream) {
  const int slots = top_k + num_shared;
  if (k % kGroup != 0 || slots < 1 || slots > kMaxSlots) return cudaErrorInvalidValue;
  return dispatch(act_kind, w.scale_kind, [&](auto t, auto s) {
    return down<decltype(t), decltype(s)>(act, stride_act, w, ids, weights, top_k, num_shared, num_routed, out, d, k,
                                          split, stream);
  });
}

}  // namespace deepinfer
