// Row RMSNorm (+ optional FP8 act quant of the result). See include/v4attn/kernels/norm_kernels.h.
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"
#include "v4attn/kernels/norm_kernels.h"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();
namespace {

constexpr int kMaxThreads = 256;  // n <= 2048: one thread per 8-element chunk

// One CTA per row, one thread per LaneSum chunk (chunk c = thread c). Why not one warp per row:
// the per-element work (normalise, bf16 round, e4m3 act quant in exact software arithmetic) is a
// long dependent chain; one warp walking 5 chunks per lane of a 1280-wide row took ~16 us per
// launch in the stack's graph (CUPTI, run 14) with the GPU otherwise idle. Here every thread
// handles one chunk, so that chain is one chunk long.
// The sum of squares must still follow the LaneSum order (numerics.h), which is a sequential sum
// per lane over chunks lane, lane+32, ...: warp 0 computes it exactly like the reference (mul/add
// only, cheap) and publishes rstd through shared memory. Block b of 32 elements for the act quant
// is chunks 4b..4b+3 = 4 consecutive threads of one warp, so its amax is a 4-lane xor combine.
// PDL: nothing but the weights is read before the wait; x is the QA GEMM's output.
template <int kMaxChunks>
__global__ void __launch_bounds__(kMaxThreads) rmsnorm_kernel(const RmsNormParams p) {
  using namespace detail;
  const int lane = threadIdx.x & 31;
  const int c = threadIdx.x;  // this thread's chunk
  const int row = blockIdx.x;
  const int n_chunks = p.n / kChunk;
  const bool active = c < n_chunks;
  float wv[kChunk];
  if (active) ldg_f32x8(p.w + c * kChunk, wv);
  [[maybe_unused]] unsigned int stamp_rec = 0u;  // measurement builds only (phase_stamps.cuh)
  if (threadIdx.x == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kRmsNorm, 0);
  if (p.trigger_at_wait) dev::pdl_wait();
  else dev::pdl_wait_no_trigger();  // successor (the wq_b GEMM) launches after the last store
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kRmsNorm, 1);
  __shared__ float s_rstd;
  const bf16_t* x = p.x + static_cast<int64_t>(row) * p.x_stride;
  float v[kChunk];
  if (active) load_bf16x8(x + c * kChunk, v);
  if (threadIdx.x < 32) {
    // LaneSum: lane l accumulates its chunks l, l+32, ... in order (all loads issued first).
    const float r = num::rmsnorm_rstd(warp_row_sum_squares_n<kMaxChunks>(x, n_chunks, lane), p.n, p.eps);
    if (lane == 0) s_rstd = r;
  }
  __syncthreads();
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kRmsNorm, 2);
  const float r = s_rstd;
  if (active) {
    rmsnorm_apply_chunk(v, r, wv);
    store_bf16x8(p.y + static_cast<int64_t>(row) * p.y_stride + c * kChunk, v);
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) v[k] = 0.0f;
  }
  if (p.q_codes != nullptr) {  // uniform branch; n % 32 == 0 so whole 4-lane groups are active
    int e = 0;
    const uint2 codes = act_quant_chunk<4>(v, e);
    if (active) {
      *reinterpret_cast<uint2*>(p.q_codes + static_cast<int64_t>(row) * p.q_stride + c * kChunk) = codes;
      if ((lane & 3) == 0) p.q_scales[static_cast<int64_t>(row) * p.s_stride + c / 4] = num::ue8m0_from_exp(e);
    }
  }
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kRmsNorm, 4);
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
  const int n_chunks = p.n / detail::kChunk;
  cfg.grid = dim3(static_cast<unsigned>(p.rows));
  cfg.block = dim3(static_cast<unsigned>((n_chunks + 31) / 32 * 32));  // whole warps: shuffles
  cfg.stream = stream;
  cfg.pdl = pdl;
  // Chunks per lane: n <= 512 -> 2, else <= 8 (q_norm 1280: 5).
  if (p.n <= 512) launch_kernel("rmsnorm", rmsnorm_kernel<2>, cfg, p);
  else launch_kernel("rmsnorm", rmsnorm_kernel<8>, cfg, p);
}

}  // namespace v4attn::kernels
