// Index-K store (spec 3.3 (a)): kproj = wk(latent_pre_rope) [N, 128] -> RMSNorm(k_norm) -> RoPE
// at g on dims 64..127 (compressed table) -> FP4 indexer quant (block 32, ue8m0) -> 68-byte slot
// (64 B e2m1 pairs + 4 ue8m0) of the paged index-K cache at out_loc. Twin of ref::index_k_store.
//
// Grid ceil(N / 2), block 64 threads: one warp per row (warp w of CTA b owns row 2b + w). The row
// is 16 LaneSum chunks: lane l < 16 holds dims [8l, 8l+8); lanes 16..31 hold nothing and add 0 to
// the butterfly, exactly the zero partials of num::lane_sum_squares for n = 128. Lanes 8..15 hold
// the RoPE half (dims 64..127). Quant block b (32 dims) = lanes 4b..4b+3; lane l stores its 4 code
// bytes at [4l, 4l+4), lane 4b stores scale byte b.
//
// PDL: before dev::pdl_wait() the warp reads out_loc[t] and g[t] (step metadata) and the constant
// k_norm weights and table row; the wait precedes the first load of kproj (the wk GEMM output);
// the trigger follows the last store. Rows that store nothing (out_loc <= 0 or out of range) return
// before the wait, like the reference, which computes nothing for them.
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kRowsPerCta = 2;
constexpr int kThreads = 32 * kRowsPerCta;
constexpr int kChunks = kPrepIndexDim / detail::kChunk;                                  // 16 lanes in use
constexpr int kTailFirstLane = (kPrepIndexDim - num::kRopeDim) / detail::kChunk;         // 8
static_assert(kPrepIndexDim % (4 * detail::kChunk) == 0, "whole quant blocks of 32");

__global__ void __launch_bounds__(kThreads) index_k_store_kernel(const __grid_constant__ IndexKStoreParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int t = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x) / 32;
  if (t >= p.N) return;

  const int32_t loc = p.out_loc[t];
  if (loc <= 0) return;  // no group slot: nothing to do (the reference computes nothing either)
  if (loc >= p.n_slots) {
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t g = p.g[t];
  if (g < 0 || g >= p.max_pos) {  // refused on the host by the reference; contained here
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const bool has_chunk = lane < kChunks;
  const bool tail_lane = has_chunk && lane >= kTailFirstLane;
  float w[detail::kChunk] = {}, cs[detail::kChunk] = {};
  if (has_chunk) detail::ldg_f32x8(p.k_norm + detail::kChunk * lane, w);
  if (tail_lane)
    detail::ldg_f32x8(p.table + static_cast<int64_t>(g) * num::kRopeDim + (lane - kTailFirstLane) * detail::kChunk, cs);

  dev::pdl_wait();  // kproj is the wk GEMM's output

  float x[1][detail::kChunk] = {};
  if (has_chunk) detail::load_bf16x8(p.kproj + static_cast<int64_t>(t) * p.kproj_row_stride + detail::kChunk * lane, x[0]);
  const float r = num::rmsnorm_rstd(dev::warp_lane_sum(detail::lane_sum_squares_part<1>(x)), kPrepIndexDim, p.eps);
  detail::rmsnorm_apply_chunk(x[0], r, w);  // lanes >= 16: zeros, never stored
  if (tail_lane) detail::rope_chunk(x[0], cs);
  int e;
  const uint32_t codes = detail::indexer_fp4_quant_chunk(x[0], e);  // all lanes join the shuffles
  if (has_chunk) {
    *reinterpret_cast<uint32_t*>(p.cache + p.layout.data_offset(loc) + 4 * lane) = codes;
    if (lane % 4 == 0) p.cache[p.layout.scale_offset(loc) + lane / 4] = num::ue8m0_from_exp(e);
  }

  dev::pdl_launch_dependents();  // after this lane's last store
}

}  // namespace

void run_index_k_store(const IndexKStoreParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_index_k_store";
  require(p.N >= 0, who, "negative N");
  require(p.kproj_row_stride >= kPrepIndexDim && p.kproj_row_stride % detail::kChunk == 0, who,
          "kproj_row_stride " + std::to_string(p.kproj_row_stride) + " must be >= 128 and a multiple of 8");
  detail::require_cache(p.layout, CacheKind::kIndexK, p.cache, p.n_slots, who);
  if (p.N == 0) return;
  detail::require_ptr(p.kproj, who, "kproj");
  detail::require_aligned(p.kproj, 16, who, "kproj");
  detail::require_ptr(p.k_norm, who, "k_norm");
  detail::require_aligned(p.k_norm, 16, who, "k_norm");
  detail::require_ptr(p.g, who, "g");
  detail::require_ptr(p.out_loc, who, "out_loc");
  detail::require_table(p.table, p.max_pos, who);

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.N + kRowsPerCta - 1) / kRowsPerCta), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("index_k_store", index_k_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
