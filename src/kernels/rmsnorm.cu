// Row RMSNorm (+ optional FP8 act quant of the result). See include/v4attn/kernels/norm_kernels.h.
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"
#include "v4attn/kernels/norm_kernels.h"

namespace v4attn::kernels {
namespace {

constexpr int kRowsPerCta = 4;

// One warp per row; lane l owns the LaneSum chunks l, l+32, ... (at most kMaxChunks of them).
// All of the lane's chunks are loaded up front (independent 16-byte loads in flight, values kept
// in registers): the kernel runs on a handful of rows, so it is bound by load latency, and a
// loop of dependent load -> use steps cost ~10 us per launch on the H200 (measured in the stack
// trace). Then the LaneSum (chunks in order, terms in order), the butterfly, and normalise /
// store / quantise from registers. Block b of 32 elements for the act quant is chunks 4b..4b+3,
// i.e. 4 consecutive lanes of the same chunk index, so its amax is a 4-lane xor combine.
// PDL: nothing but the weights is read before the wait; x is the QA GEMM's output.
template <int kMaxChunks>
__global__ void __launch_bounds__(32 * kRowsPerCta) rmsnorm_kernel(const RmsNormParams p) {
  using namespace detail;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerCta + (threadIdx.x >> 5);
  const int n_chunks = p.n / kChunk;
  float wv[kMaxChunks][kChunk];
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = lane + 32 * i;
    if (c < n_chunks) ldg_f32x8(p.w + c * kChunk, wv[i]);
  }
  dev::pdl_wait();
  if (row < p.rows) {
    const bf16_t* x = p.x + static_cast<int64_t>(row) * p.x_stride;
    float v[kMaxChunks][kChunk];
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      const int c = lane + 32 * i;
      if (c < n_chunks) load_bf16x8(x + c * kChunk, v[i]);
    }
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i)
      if (lane + 32 * i < n_chunks)
#pragma unroll
        for (int k = 0; k < kChunk; ++k) acc = num::add_rn(acc, num::mul_rn(v[i][k], v[i][k]));
    const float r = num::rmsnorm_rstd(dev::warp_lane_sum(acc), p.n, p.eps);
    bf16_t* y = p.y + static_cast<int64_t>(row) * p.y_stride;
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      const int c = lane + 32 * i;
      const bool active = c < n_chunks;
      if (32 * i >= n_chunks) break;  // warp-uniform: no lane has chunk index i
      if (active) {
        rmsnorm_apply_chunk(v[i], r, wv[i]);
        store_bf16x8(y + c * kChunk, v[i]);
      } else {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) v[i][k] = 0.0f;
      }
      if (p.q_codes != nullptr) {  // uniform branch; n % 32 == 0 so whole 4-lane groups are active
        int e = 0;
        const uint2 codes = act_quant_chunk<4>(v[i], e);
        if (active) {
          *reinterpret_cast<uint2*>(p.q_codes + static_cast<int64_t>(row) * p.q_stride + c * kChunk) = codes;
          if ((lane & 3) == 0) p.q_scales[static_cast<int64_t>(row) * p.s_stride + c / 4] = num::ue8m0_from_exp(e);
        }
      }
    }
  }
  dev::pdl_launch_dependents();
}

}  // namespace

void run_rmsnorm(const RmsNormParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  using detail::require_ptr;
  const char* who = "run_rmsnorm";
  require(p.rows >= 0, who, "rows must be >= 0");
  require(p.n > 0 && p.n % 8 == 0 && p.n <= 2048, who, "n must be a positive multiple of 8, <= 2048");
  if (p.rows == 0) return;
  require_ptr(p.x, who, "x");
  require_ptr(p.y, who, "y");
  require_ptr(p.w, who, "w");
  require(p.x_stride >= p.n && p.x_stride % 8 == 0, who, "x_stride must be >= n and a multiple of 8");
  require(p.y_stride >= p.n && p.y_stride % 8 == 0, who, "y_stride must be >= n and a multiple of 8");
  detail::require_aligned(p.x, 16, who, "x");
  detail::require_aligned(p.y, 16, who, "y");
  detail::require_aligned(p.w, 16, who, "w");
  if (p.q_codes != nullptr || p.q_scales != nullptr) {
    require_ptr(p.q_codes, who, "q_codes");
    require_ptr(p.q_scales, who, "q_scales");
    require(p.n % 32 == 0, who, "n must be a multiple of 32 to quantise");
    require(p.q_stride >= p.n && p.q_stride % 8 == 0, who, "q_stride must be >= n and a multiple of 8");
    require(p.s_stride >= p.n / 32, who, "s_stride must be >= n / 32");
    detail::require_aligned(p.q_codes, 8, who, "q_codes");
  }
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.rows + kRowsPerCta - 1) / kRowsPerCta));
  cfg.block = dim3(32 * kRowsPerCta);
  cfg.stream = stream;
  cfg.pdl = pdl;
  // Chunks per lane: n <= 512 -> 2, else <= 8 (q_norm 1280: 5).
  if (p.n <= 512) launch_kernel("rmsnorm", rmsnorm_kernel<2>, cfg, p);
  else launch_kernel("rmsnorm", rmsnorm_kernel<8>, cfg, p);
}

}  // namespace v4attn::kernels
