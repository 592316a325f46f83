// v1 of the fp32 GEMM (ratio-2 compressor: x bf16 widened to fp32, [wkv; wgate] fp32 weights,
// fp32 out) on the CUDA cores.
//
// Grid (ceil(m / 16), n / 4), block 256 (8 warps). One CTA owns 4 weight rows x 16 tokens; the
// token tile is the fastest grid dimension, so the CTAs that share weight rows run side by side
// and read the rows from HBM once (L2 serves the rest). Warp w owns the w-th of 8 contiguous
// slices of K (in float4 units); lane l takes the float4s l, l + 32, ... of that slice (16-byte
// weight loads, the next float4s of the 4 rows in flight while the current ones are used), and
// accumulates 4 x 16 fp32 sums with fma, in increasing k. Then a reduce-scatter butterfly over
// the lanes (offsets 16, 8, 4, 2, 1) leaves lane l with the sums of (row, token) indices 2l and
// 2l + 1, and 64 threads add the 8 warps' sums in warp order. Every step has a fixed order, so
// the result is deterministic; it differs from the reference's sequential fp32 sum by rounding.
#include "gemm/gemm_internal.h"
#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kRows = 4;      // weight rows per CTA
constexpr int kTokens = 16;   // tokens per CTA
constexpr int kWarps = 8;     // K slices per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kSums = kRows * kTokens;  // 64 = 2 per lane after the reduce-scatter
static_assert(kSums == 64, "the reduce-scatter below is written for 64 sums per lane");

struct F32WarpParams {
  const bf16_t* x = nullptr;  // [m, k]; row r at x + r * x_stride (8-byte aligned rows)
  int64_t x_stride = 0;
  const float* w = nullptr;   // [n, k] dense, 16-byte aligned
  float* out = nullptr;       // [m, n]; row r at out + r * out_stride
  int64_t out_stride = 0;
  int m = 0;
  int64_t n = 0;
  int64_t k4 = 0;             // k / 4
};

// One halving step of the reduce-scatter: 2H live sums -> H. Lanes with (lane & off) keep the
// upper half and send the lower; their partners do the opposite; both then hold the same H
// indices' sums of the pair (kept + received, in that order).
template <int H>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[kSums], int lane, int off) {
  const bool upper = (lane & off) != 0;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float send = upper ? v[i] : v[i + H];
    const float keep = upper ? v[i + H] : v[i];
    v[i] = num::add_rn(keep, __shfl_xor_sync(0xffffffffu, send, off));
  }
}

__global__ void __launch_bounds__(kThreads) gemm_f32_warp_kernel(const __grid_constant__ F32WarpParams p) {
  __shared__ float red[kWarps][kSums];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int tok0 = static_cast<int>(blockIdx.x) * kTokens;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int tokens = min(kTokens, p.m - tok0);
  const int64_t q_begin = warp * p.k4 / kWarps, q_end = (warp + 1) * p.k4 / kWarps;

  const float4* wrow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) wrow[r] = reinterpret_cast<const float4*>(p.w + (row0 + r) * (p.k4 * 4));

  // The first weight float4s are constants: load them before waiting for the predecessor.
  float4 wcur[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) wcur[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  int64_t q = q_begin + lane;
  const uint64_t stream = dev::l2_policy_stream();  // weights: read once per cycle
  if (q < q_end) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) wcur[r] = dev::ldg_stream(wrow[r] + q, stream);
  }
  dev::pdl_wait();  // x is the predecessor's output

  float v[kSums];
#pragma unroll
  for (int i = 0; i < kSums; ++i) v[i] = 0.0f;

  for (; q < q_end; q += 32) {
    float4 wnext[kRows];
    const bool more = q + 32 < q_end;
    if (more) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) wnext[r] = dev::ldg_stream(wrow[r] + q + 32, stream);
    }
#pragma unroll
    for (int tm = 0; tm < kTokens; ++tm) {
      if (tm < tokens) {  // uniform across the CTA
        const uint2 xv = *reinterpret_cast<const uint2*>(p.x + (tok0 + tm) * p.x_stride + q * 4);
        const float x0 = num::f32_from_bits(xv.x << 16), x1 = num::f32_from_bits(xv.x & 0xffff0000u);
        const float x2 = num::f32_from_bits(xv.y << 16), x3 = num::f32_from_bits(xv.y & 0xffff0000u);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float a = v[r * kTokens + tm];
          a = __fmaf_rn(x0, wcur[r].x, a);
          a = __fmaf_rn(x1, wcur[r].y, a);
          a = __fmaf_rn(x2, wcur[r].z, a);
          a = __fmaf_rn(x3, wcur[r].w, a);
          v[r * kTokens + tm] = a;
        }
      }
    }
    if (more) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) wcur[r] = wnext[r];
    }
  }
  dev::pdl_launch_dependents();

  // Lane l ends with the sums of indices 2l and 2l + 1 (index = row * 16 + token).
  reduce_scatter_step<32>(v, lane, 16);
  reduce_scatter_step<16>(v, lane, 8);
  reduce_scatter_step<8>(v, lane, 4);
  reduce_scatter_step<4>(v, lane, 2);
  reduce_scatter_step<2>(v, lane, 1);
  red[warp][2 * lane] = v[0];
  red[warp][2 * lane + 1] = v[1];
  __syncthreads();
  if (tid < kSums) {
    const int r = tid / kTokens, tm = tid % kTokens;
    float sum = red[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum = num::add_rn(sum, red[w][tid]);
    if (tm < tokens) p.out[(tok0 + tm) * p.out_stride + row0 + r] = sum;
  }
}

}  // namespace

namespace detail {

void launch_gemm_f32_warp(const F32GemmParams& p, cudaStream_t stream, bool pdl) {
  F32WarpParams q;
  q.x = p.x;
  q.x_stride = p.x_stride;
  q.w = p.w;
  q.out = p.out;
  q.out_stride = p.out_stride;
  q.m = p.m;
  q.n = p.n;
  q.k4 = p.k / 4;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.m + kTokens - 1) / kTokens), static_cast<unsigned>(p.n / kRows));
  cfg.block = dim3(kThreads);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("gemm_f32_warp", gemm_f32_warp_kernel, cfg, q);
}

}  // namespace detail
}  // namespace v4attn::kernels
