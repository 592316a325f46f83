// Index-K store (spec 3.3 (a)): kproj = wk(latent_pre_rope) [N, 128] -> RMSNorm(k_norm) -> RoPE
// at g on dims 64..127 (compressed table) -> FP4 indexer quant (block 32, ue8m0) -> 68-byte slot
// (64 B e2m1 pairs + 4 ue8m0) of the paged index-K cache at out_loc. Twin of ref::index_k_store.
//
// Grid N CTAs of 64 threads, pair per thread (prepare_common.cuh): thread j of row t owns dims 2j,
// 2j+1 (j in 0..63); warp 1 holds the RoPE half (dims 64..127). Each of the two warps computes the
// row's RMSNorm sum of squares itself in the LaneSum order (detail::warp_row_sum_squares: lane
// l < 16 holds chunk l, lanes 16..31 add 0, exactly the zero partials of num::lane_sum_squares for
// n = 128). Quant block b (dims 32b..32b+31) = the 16 lanes 16b..16b+15 (mod 32); thread j stores
// code byte j, thread 16b stores scale byte b. (The previous version gave each row one warp, 8
// dims per lane: six rows ran six warps through long exact-numerics chains.)
//
// PDL: before dev::pdl_wait() a thread reads out_loc[t] and g[t] (step metadata, both loads in
// flight together) and the constant k_norm weights and table entry; the wait precedes the first
// load of kproj (the wk GEMM output); the trigger follows the last store. Rows that store nothing
// (out_loc <= 0 or out of range) return before the wait, like the reference, which computes
// nothing for them. Errors are counted once per row (by thread 0).
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kThreads = kPrepIndexDim / 2;                                   // 64: one per pair
constexpr int kTailFirstPair = (kPrepIndexDim - num::kRopeDim) / 2;           // 32: warp 1
constexpr int kBlockPairs = num::kIndexerQuantBlock / 2;                      // 16 lanes per block
static_assert(kTailFirstPair % 32 == 0, "the RoPE pairs are a whole warp (uniform branch)");
static_assert(kPrepIndexDim % num::kIndexerQuantBlock == 0, "whole quant blocks of 32");

__global__ void __launch_bounds__(kThreads) index_k_store_kernel(const __grid_constant__ IndexKStoreParams p) {
  const int t = static_cast<int>(blockIdx.x);
  const int j = static_cast<int>(threadIdx.x);
  const int lane = j % 32;

  const int32_t loc = p.out_loc[t];
  const int32_t g = p.g[t];
  if (loc <= 0) return;  // no group slot: nothing to do (the reference computes nothing either)
  if (loc >= p.n_slots) {
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  if (g < 0 || g >= p.max_pos) {  // refused on the host by the reference; contained here
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  const bool tail = j >= kTailFirstPair;
  const float2 w = detail::ldg_f32x2(p.k_norm + 2 * j);
  const float2 cs = tail ? detail::ldg_f32x2(p.table + static_cast<int64_t>(g) * num::kRopeDim + 2 * (j - kTailFirstPair))
                         : make_float2(0.0f, 0.0f);

  dev::pdl_wait();  // kproj is the wk GEMM's output

  const bf16_t* row = p.kproj + static_cast<int64_t>(t) * p.kproj_row_stride;
  float x0, x1;
  detail::load_bf16x2(row + 2 * j, x0, x1);
  const float r = num::rmsnorm_rstd(detail::warp_row_sum_squares<kPrepIndexDim>(row, lane), kPrepIndexDim, p.eps);
  detail::rmsnorm_apply_pair(x0, x1, r, w);
  if (tail) detail::rope_pair(x0, x1, cs);
  const int e = num::indexer_quant_scale_exp(detail::lane_group_amax<kBlockPairs>(detail::pair_amax(x0, x1)));
  p.cache[p.layout.data_offset(loc) + j] = detail::fp4_code_pair(x0, x1, num::pow2_f32(e));
  if (j % kBlockPairs == 0) p.cache[p.layout.scale_offset(loc) + j / kBlockPairs] = num::ue8m0_from_exp(e);

  dev::pdl_launch_dependents();  // after this thread's last store
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
  cfg.grid = dim3(static_cast<unsigned>(p.N), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("index_k_store", index_k_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
