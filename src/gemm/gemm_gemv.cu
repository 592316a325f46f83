// v6 of the fp8 GEMM ("gemv"): latency first, for a few rows (m <= kGemvMaxRows) against a small
// weight (the indexer's wq_b, 4096 x 1280: 5.2 MB), where v2 / v3 spend most of their time in
// structure -- cluster scheduling, a TMA ring, converter warps, a split-K hand-off -- rather than
// in the stream (session 22: v3 ~7 us own after the fused Q chain for a ~1.2 us stream).
//
// Grid (n / 16), block 32 S (S warps). One CTA owns 16 weight rows (one m16 tile, inside one
// 32-row weight-scale group) and every token; warp w owns the contiguous K blocks
// [w kb / S, (w + 1) kb / S) (at most kGemvMaxBlocksPerWarp; S = ceil(kb / 10) <= 16 by the host,
// a function of k only). Each lane loads its fragments straight from global memory into registers,
// all of them BEFORE dev::pdl_wait() (weights and their scales are constants): no shared-memory
// ring, no producer, one latency for the whole weight slice.
//
// mma.sync m16n8k16 (f16 x f16 -> f32), the weight as the 16-row A operand, the tokens as the
// 8-column B operand (tokens >= m are zeros), exactly v1's fragment mapping (gemm_tc.cu): lane
// (g = lane / 4, t = lane % 4) holds, per 32-wide K block, the bytes [8t, 8t + 8) of weight rows g
// and g + 8 and of token g's codes; the first mma takes bytes 8t .. 8t + 3, the second 8t + 4 ..
// 8t + 7 (a bijection of the block's 32 k onto the two mmas' logical k, the same for A and B),
// each e4m3 pair widened to f16x2 by cvt (exact: every e4m3 value is an f16 value).
//
// Numerics (gemm.h): per block, the two chained mmas form the block sum from zero; then
// acc = fma(blocksum, sa * sw, acc) in block order from +0 over the warp's range (sa * sw is a
// power of two: one rounding, like the reference's acc + ((blocksum * sa) * sw)); the S warps'
// partial sums are added in warp order ((P0 + P1) + P2) + ... through shared memory, like v1's
// split-K in split order. S depends on k only, so a token's output does not depend on the batch.
// Same class of difference from the reference as v1 / v2 / v3 (the order inside a block, and the
// split structure): within 1 bf16 ulp in rare elements.
//
// Bytes: the weight slice and its scales once, the tokens' codes once per CTA (L2), the output.
#include <algorithm>
#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kTileRows = 16;      // weight rows per CTA (one m16 tile)
constexpr int kMaxWarps = kGemvMaxWarps;  // K splits per CTA (512 threads: up to 128 registers each)

// Weight bytes: read once per cycle (L2 evict-first, like every streamed weight byte).
__device__ __forceinline__ uint2 ldg_stream_u2(const void* p, uint64_t policy) {
  uint2 v;
  asm volatile("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;\n" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(policy));
  return v;
}

// The low / high e4m3 pair of a 32-bit word (bytes 0-1 / 2-3) as f16x2.
__device__ __forceinline__ uint32_t lo_f16x2(uint32_t w) { return hopper::e4m3x2_lo_to_f16x2(w); }
__device__ __forceinline__ uint32_t hi_f16x2(uint32_t w) { return hopper::e4m3x2_hi_to_f16x2(w); }

__global__ void __launch_bounds__(kMaxWarps * 32) gemm_fp8_gemv_kernel(const __grid_constant__ Fp8GemmParams p) {
  constexpr int MB = kGemvMaxBlocksPerWarp;
  __shared__ float red[kMaxWarps][32][4];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int S = static_cast<int>(blockDim.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t kb = p.k / kGemmBlock;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t b0 = warp * kb / S, nb = (warp + 1) * kb / S - b0;  // this warp's K blocks

  // ---- before the PDL wait: the warp's weight fragments and their scales (constants) ----
  const uint64_t policy = dev::l2_policy_stream();
  const uint8_t* wg = p.w + (row0 + g) * p.k + b0 * kGemmBlock + 8 * t;  // row g; row g + 8 at + 8 k
  const uint8_t* sw_row = p.w_scale + (row0 / kGemmBlock) * kb + b0;
  uint2 wa[MB], wb[MB];
  float swv[MB];
#pragma unroll
  for (int j = 0; j < MB; ++j)
    if (j < nb) {
      wa[j] = ldg_stream_u2(wg + j * kGemmBlock, policy);
      wb[j] = ldg_stream_u2(wg + 8 * p.k + j * kGemmBlock, policy);
      swv[j] = num::f32_from_ue8m0(sw_row[j]);
    }

  dev::pdl_wait();  // the activation codes and scales come from the predecessor

  // ---- the tokens' codes (token g) and scales (tokens 2t, 2t + 1: this lane's C columns) ----
  uint2 xa[MB];
  float sa0[MB], sa1[MB];
  const bool tok_g = g < p.m, tok0 = 2 * t < p.m, tok1 = 2 * t + 1 < p.m;
  const uint8_t* xg = p.a_q + static_cast<int64_t>(tok_g ? g : 0) * p.a_stride + b0 * kGemmBlock + 8 * t;
  const uint8_t* s0 = p.a_scale + static_cast<int64_t>(tok0 ? 2 * t : 0) * p.a_scale_stride + b0;
  const uint8_t* s1 = p.a_scale + static_cast<int64_t>(tok1 ? 2 * t + 1 : 0) * p.a_scale_stride + b0;
#pragma unroll
  for (int j = 0; j < MB; ++j)
    if (j < nb) {
      xa[j] = tok_g ? *reinterpret_cast<const uint2*>(xg + j * kGemmBlock) : make_uint2(0u, 0u);
      sa0[j] = tok0 ? num::f32_from_ue8m0(s0[j]) : 0.0f;
      sa1[j] = tok1 ? num::f32_from_ue8m0(s1[j]) : 0.0f;
    }

  // ---- block sums by the tensor core, folded in block order ----
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < MB; ++j)
    if (j < nb) {
      // A: a0 = (row g, k 2t..), a1 = (row g + 8, k 2t..), a2 = (row g, k 2t + 8..), a3 = (row g + 8, ..)
      const uint32_t a_first[4] = {lo_f16x2(wa[j].x), lo_f16x2(wb[j].x), hi_f16x2(wa[j].x), hi_f16x2(wb[j].x)};
      const uint32_t a_second[4] = {lo_f16x2(wa[j].y), lo_f16x2(wb[j].y), hi_f16x2(wa[j].y), hi_f16x2(wb[j].y)};
      float d[4];
      hopper::mma_m16n8k16<true>(d, a_first, lo_f16x2(xa[j].x), hi_f16x2(xa[j].x), zero4);  // bytes 8t .. 8t + 3
      hopper::mma_m16n8k16<true>(d, a_second, lo_f16x2(xa[j].y), hi_f16x2(xa[j].y), d);     // bytes 8t + 4 .. 8t + 7
      // sa * sw is a power of two: exact; so is blocksum * (sa * sw). One rounding.
      const float c0 = num::mul_rn(sa0[j], swv[j]), c1 = num::mul_rn(sa1[j], swv[j]);
      acc[0] = __fmaf_rn(d[0], c0, acc[0]);  // (row g, token 2t)
      acc[1] = __fmaf_rn(d[1], c1, acc[1]);  // (row g, token 2t + 1)
      acc[2] = __fmaf_rn(d[2], c0, acc[2]);  // (row g + 8, token 2t)
      acc[3] = __fmaf_rn(d[3], c1, acc[3]);  // (row g + 8, token 2t + 1)
    }
  dev::pdl_launch_dependents();

  // ---- the warps' partials in warp order, then bf16 ----
  if (S > 1) {
    *reinterpret_cast<float4*>(red[warp][lane]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = red[0][lane][i];
    for (int w = 1; w < S; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(red[w][lane]);
      acc[0] = num::add_rn(acc[0], v.x);
      acc[1] = num::add_rn(acc[1], v.y);
      acc[2] = num::add_rn(acc[2], v.z);
      acc[3] = num::add_rn(acc[3], v.w);
    }
  }
  const int64_t r_lo = row0 + g, r_hi = row0 + g + 8;
  if (tok0) {
    p.out[static_cast<int64_t>(2 * t) * p.out_stride + r_lo] = num::bf16_from_f32(acc[0]);
    p.out[static_cast<int64_t>(2 * t) * p.out_stride + r_hi] = num::bf16_from_f32(acc[2]);
  }
  if (tok1) {
    p.out[static_cast<int64_t>(2 * t + 1) * p.out_stride + r_lo] = num::bf16_from_f32(acc[1]);
    p.out[static_cast<int64_t>(2 * t + 1) * p.out_stride + r_hi] = num::bf16_from_f32(acc[3]);
  }
}

}  // namespace

GemmPlan plan_gemm_gemv(int m, int64_t n, int64_t k) {
  GemmPlan plan;
  plan.warp_mtiles = 1;
  plan.block_n = kTileRows;
  plan.tiles_n = static_cast<int>(std::max<int64_t>(n, 0) / kTileRows);
  const int64_t kb = std::max<int64_t>(k, 0) / kGemmBlock;
  plan.splits = static_cast<int>(std::max<int64_t>(1, (kb + kGemvMaxBlocksPerWarp - 1) / kGemvMaxBlocksPerWarp));
  (void)m;  // the plan depends on (n, k) only: a token's output does not depend on its batch
  return plan;
}

bool gemm_gemv_supported(int m, int64_t n, int64_t k, int groups) {
  if (m < 1 || m > kGemvMaxRows || groups != 1) return false;
  if (n <= 0 || n % kGemmBlock != 0 || k <= 0 || k % kGemmBlock != 0) return false;
  if (n / kTileRows > 0x7fffffff) return false;
  return plan_gemm_gemv(m, n, k).splits <= kMaxWarps;
}

namespace detail {

void launch_gemm_fp8_gemv(const Fp8GemmParams& p, cudaStream_t stream, bool pdl) {
  const GemmPlan plan = plan_gemm_gemv(p.m, p.n, p.k);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), 1, 1);
  cfg.block = dim3(static_cast<unsigned>(32 * plan.splits), 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("gemm_fp8_gemv", gemm_fp8_gemv_kernel, cfg, p);
}

}  // namespace detail

}  // namespace v4attn::kernels
