// v6 of the fp8 GEMM ("gemv"): latency first, for a few rows (m <= kGemvMaxRows) against a small
// weight (the indexer's wq_b, 4096 x 1280: 5.2 MB), where v2 / v3 spend most of their time in
// structure -- cluster scheduling, a TMA ring, converter warps, a split-K hand-off -- rather than
// in the stream (session 22: v3 ~7 us own after the fused Q chain for a ~1.2 us stream).
//
// Grid (n / 16), block 32 S (S warps). One CTA owns 16 weight rows (one m16 tile, inside one
// 32-row weight-scale group) and every token; warp w owns the contiguous K blocks
// [w kb / S, (w + 1) kb / S) (at most kGemvMaxBlocksPerWarp; S = ceil(kb / 10) by the host, a
// function of k only: <= 16, and <= 8 with two token tiles). Each lane loads its fragments straight
// from global memory into registers, all of them BEFORE dev::pdl_wait() (weights and their scales are
// constants): no shared-memory ring, no producer, one latency for the whole weight slice; after the
// wait its tokens' codes and scales (NT = 1 or 2 n8 tiles, m <= 8 NT) into registers too.
//
// mma.sync m16n8k16 (f16 x f16 -> f32), the weight as the 16-row A operand, each n8 tile of tokens
// as the B operand (tokens >= m are zeros), exactly v1's fragment mapping (gemm_tc.cu): lane
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
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

constexpr int kTileRows = 16;      // weight rows per CTA (one m16 tile)
constexpr int kTileTokens = 8;     // tokens per n8 tile (B operand columns); one or two tiles
static_assert(kGemvMaxRows == 2 * kTileTokens, "the kernels take one or two n8 tiles of tokens");
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

// NT n8 tiles of tokens (m <= 8 NT): token nt * 8 + g's codes and the scales of tokens
// nt * 8 + 2t, + 1 per tile, all in registers. Two tiles take at most kMaxWarps2 warps (so up to
// 255 registers per thread: their codes and scales double).
constexpr int kMaxWarps2 = kGemvMaxWarps / 2;  // so k <= kGemvMaxK / 2
template <int NT>
__global__ void __launch_bounds__((NT == 1 ? kMaxWarps : kMaxWarps2) * 32)
    gemm_fp8_gemv_kernel(const __grid_constant__ Fp8GemmParams p) {
  constexpr int MB = kGemvMaxBlocksPerWarp;
  __shared__ float red[NT == 1 ? kMaxWarps : kMaxWarps2][32][4 * NT];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int S = static_cast<int>(blockDim.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t kb = p.k / kGemmBlock;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t b0 = warp * kb / S, nb = (warp + 1) * kb / S - b0;  // this warp's K blocks

  // ---- before the PDL wait: the warp's weight fragments and their scales (constants) ----
  [[maybe_unused]] unsigned int stamp_rec = 0u;
  if (threadIdx.x == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemv, 0);
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
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemv, 1);

  // ---- the tokens' codes (token nt * 8 + g) and scales (tokens nt * 8 + 2t, + 1: this lane's C columns) ----
  uint2 xa[NT][MB];
  float sa0[NT][MB], sa1[NT][MB];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tg = nt * 8 + g, t0 = nt * 8 + 2 * t, t1 = t0 + 1;
    const bool tok_g = tg < p.m, tok0 = t0 < p.m, tok1 = t1 < p.m;
    const uint8_t* xg = p.a_q + static_cast<int64_t>(tok_g ? tg : 0) * p.a_stride + b0 * kGemmBlock + 8 * t;
    const uint8_t* s0 = p.a_scale + static_cast<int64_t>(tok0 ? t0 : 0) * p.a_scale_stride + b0;
    const uint8_t* s1 = p.a_scale + static_cast<int64_t>(tok1 ? t1 : 0) * p.a_scale_stride + b0;
#pragma unroll
    for (int j = 0; j < MB; ++j)
      if (j < nb) {
        xa[nt][j] = tok_g ? *reinterpret_cast<const uint2*>(xg + j * kGemmBlock) : make_uint2(0u, 0u);
        sa0[nt][j] = tok0 ? num::f32_from_ue8m0(s0[j]) : 0.0f;
        sa1[nt][j] = tok1 ? num::f32_from_ue8m0(s1[j]) : 0.0f;
      }
  }

  // ---- block sums by the tensor core, folded in block order ----
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < MB; ++j)
    if (j < nb) {
      // A: a0 = (row g, k 2t..), a1 = (row g + 8, k 2t..), a2 = (row g, k 2t + 8..), a3 = (row g + 8, ..)
      const uint32_t a_first[4] = {lo_f16x2(wa[j].x), lo_f16x2(wb[j].x), hi_f16x2(wa[j].x), hi_f16x2(wb[j].x)};
      const uint32_t a_second[4] = {lo_f16x2(wa[j].y), lo_f16x2(wb[j].y), hi_f16x2(wa[j].y), hi_f16x2(wb[j].y)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float d[4];
        hopper::mma_m16n8k16<true>(d, a_first, lo_f16x2(xa[nt][j].x), hi_f16x2(xa[nt][j].x), zero4);  // bytes 8t .. 8t + 3
        hopper::mma_m16n8k16<true>(d, a_second, lo_f16x2(xa[nt][j].y), hi_f16x2(xa[nt][j].y), d);     // bytes 8t + 4 .. 8t + 7
        // sa * sw is a power of two: exact; so is blocksum * (sa * sw). One rounding.
        const float c0 = num::mul_rn(sa0[nt][j], swv[j]), c1 = num::mul_rn(sa1[nt][j], swv[j]);
        acc[nt][0] = __fmaf_rn(d[0], c0, acc[nt][0]);  // (row g, token 2t)
        acc[nt][1] = __fmaf_rn(d[1], c1, acc[nt][1]);  // (row g, token 2t + 1)
        acc[nt][2] = __fmaf_rn(d[2], c0, acc[nt][2]);  // (row g + 8, token 2t)
        acc[nt][3] = __fmaf_rn(d[3], c1, acc[nt][3]);  // (row g + 8, token 2t + 1)
      }
    }
  dev::pdl_launch_dependents();

  // ---- the warps' partials in warp order, then bf16 ----
  if (S > 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float4*>(&red[warp][lane][4 * nt]) = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    __syncthreads();
    if (warp != 0) return;
    for (int w = 1; w < S; ++w)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float4 v = *reinterpret_cast<const float4*>(&red[w][lane][4 * nt]);
        acc[nt][0] = num::add_rn(acc[nt][0], v.x);
        acc[nt][1] = num::add_rn(acc[nt][1], v.y);
        acc[nt][2] = num::add_rn(acc[nt][2], v.z);
        acc[nt][3] = num::add_rn(acc[nt][3], v.w);
      }
  }
  const int64_t r_lo = row0 + g, r_hi = row0 + g + 8;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int t0 = nt * 8 + 2 * t, t1 = t0 + 1;
    if (t0 < p.m) {
      p.out[static_cast<int64_t>(t0) * p.out_stride + r_lo] = num::bf16_from_f32(acc[nt][0]);
      p.out[static_cast<int64_t>(t0) * p.out_stride + r_hi] = num::bf16_from_f32(acc[nt][2]);
    }
    if (t1 < p.m) {
      p.out[static_cast<int64_t>(t1) * p.out_stride + r_lo] = num::bf16_from_f32(acc[nt][1]);
      p.out[static_cast<int64_t>(t1) * p.out_stride + r_hi] = num::bf16_from_f32(acc[nt][3]);
    }
  }
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemv, 4);
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
  return plan_gemm_gemv(m, n, k).splits <= (m <= kTileTokens ? kMaxWarps : kMaxWarps2);  // two tiles: k <= 2560
}

namespace detail {

void launch_gemm_fp8_gemv(const Fp8GemmParams& p, cudaStream_t stream, bool pdl) {
  const GemmPlan plan = plan_gemm_gemv(p.m, p.n, p.k);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), 1, 1);
  cfg.block = dim3(static_cast<unsigned>(32 * plan.splits), 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  if (p.m <= kTileTokens) launch_kernel("gemm_fp8_gemv", gemm_fp8_gemv_kernel<1>, cfg, p);
  else launch_kernel("gemm_fp8_gemv", gemm_fp8_gemv_kernel<2>, cfg, p);
}

}  // namespace detail

}  // namespace v4attn::kernels
