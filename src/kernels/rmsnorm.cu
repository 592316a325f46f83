// Row RMSNorm (+ optional FP8 act quant of the result). See include/v4attn/kernels/norm_kernels.h.
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"
#include "v4attn/kernels/norm_kernels.h"

namespace v4attn::kernels {
namespace {

constexpr int kRowsPerCta = 4;

// One warp per row. Pass 1: the lane's LaneSum part over its chunks (c = lane, lane+32, ...).
// Pass 2: re-read each chunk (L1/L2 hit), normalise, store y and, when asked, quantise: block b
// of 32 elements is chunks 4b..4b+3, i.e. 4 consecutive lanes of the same iteration, so its amax
// is a 4-lane xor combine.
// PDL: nothing but the weights is read before the wait; x is the QA GEMM's output.
__global__ void __launch_bounds__(32 * kRowsPerCta) rmsnorm_kernel(const RmsNormParams p) {
  using namespace detail;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerCta + (threadIdx.x >> 5);
  dev::pdl_wait();
  if (row < p.rows) {
    const bf16_t* x = p.x + static_cast<int64_t>(row) * p.x_stride;
    const int n_chunks = p.n / kChunk;
    float acc = 0.0f;
    for (int c = lane; c < n_chunks; c += 32) {
      float v[kChunk];
      load_bf16x8(x + c * kChunk, v);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) acc = num::add_rn(acc, num::mul_rn(v[k], v[k]));
    }
    const float r = num::rmsnorm_rstd(dev::warp_lane_sum(acc), p.n, p.eps);
    bf16_t* y = p.y + static_cast<int64_t>(row) * p.y_stride;
    // Iterate a warp-uniform number of times so the quantiser's shuffles see all 32 lanes.
    for (int base = 0; base < n_chunks; base += 32) {
      const int c = base + lane;
      const bool active = c < n_chunks;
      float v[kChunk] = {};
      if (active) {
        float wv[kChunk];
        load_bf16x8(x + c * kChunk, v);
        ldg_f32x8(p.w + c * kChunk, wv);
        rmsnorm_apply_chunk(v, r, wv);
        store_bf16x8(y + c * kChunk, v);
      }
      if (p.q_codes != nullptr) {  // uniform branch; n % 32 == 0 so whole 4-lane groups are active
        int e = 0;
        const uint2 codes = act_quant_chunk<4>(v, e);
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
  require(p.n > 0 && p.n % 8 == 0 && p.n <= 8192, who, "n must be a positive multiple of 8, <= 8192");
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
  launch_kernel("rmsnorm", rmsnorm_kernel, cfg, p);
}

}  // namespace v4attn::kernels
