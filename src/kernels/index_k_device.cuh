// The index-K store's per-pair body (spec 3.3 (a)), shared by index_k_store_kernel (index_k.cu)
// and the fused compressor tails (compressor.cu: c2 or c1 -> wk -> index-K in one kernel).
// Pair j (0..63) of row t: dims 2j, 2j+1; see index_k.cu for the layout of the work.
#pragma once

#include "kernels/prepare_common.cuh"
#include "v4attn/kernels/prepare_kernels.h"

namespace v4attn::kernels::detail {

namespace index_k {
constexpr int kThreads = kPrepIndexDim / 2;                                   // 64: one per pair
constexpr int kTailFirstPair = (kPrepIndexDim - num::kRopeDim) / 2;           // 32: warp 1
constexpr int kBlockPairs = num::kIndexerQuantBlock / 2;                      // 16 lanes per block
static_assert(kTailFirstPair % 32 == 0, "the RoPE pairs are a whole warp (uniform branch)");
static_assert(kPrepIndexDim % num::kIndexerQuantBlock == 0, "whole quant blocks of 32");
}  // namespace index_k

// run_index_k_store's argument checks (index_k.cu; also the fused compressor tail's). False: N == 0.
bool require_index_k_store(const IndexKStoreParams& p, const char* who);

// Row t's verdict (index-K slots start at 1: out_loc <= 0 has no slot; g must be inside the table).
__device__ __forceinline__ PagedRow index_k_row_verdict(const IndexKStoreParams& p, int t) {
  return paged_row_verdict(p.out_loc[t], 1, p.n_slots, p.g[t], p.max_pos);
}

// kPdlWait: wait for the stream predecessor (dev::pdl_wait) after the metadata and constant loads,
// before the first load of the kproj row (the standalone kernel). Without it the caller guarantees
// the row is visible (the fused compressor tail wrote it, then a CTA barrier). Rows that store
// nothing (out_loc <= 0 or out of range, g outside the table) return before the wait; errors are
// counted once per row (pair 0). Both warps of the row (pairs 0..63) call it.
template <bool kPdlWait>
__device__ __forceinline__ void index_k_store_pair(const IndexKStoreParams& p, int t, int j) {
  using namespace index_k;
  const int lane = j % 32;
  const PagedRow verdict = index_k_row_verdict(p, t);
  if (verdict != PagedRow::kWrite) {
    if (verdict == PagedRow::kCounted && j == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t loc = p.out_loc[t];
  const int32_t g = p.g[t];
  const bool tail = j >= kTailFirstPair;
  const float2 w = ldg_f32x2(p.k_norm + 2 * j);
  const float2 cs = tail ? ldg_f32x2(p.table + static_cast<int64_t>(g) * num::kRopeDim + 2 * (j - kTailFirstPair))
                         : make_float2(0.0f, 0.0f);

  if constexpr (kPdlWait) dev::pdl_wait();  // kproj is the wk GEMM's output

  const bf16_t* row = p.kproj + static_cast<int64_t>(t) * p.kproj_row_stride;
  float x0, x1;
  load_bf16x2(row + 2 * j, x0, x1);
  const float r = num::rmsnorm_rstd(warp_row_sum_squares<kPrepIndexDim>(row, lane), kPrepIndexDim, p.eps);
  rmsnorm_apply_pair(x0, x1, r, w);
  if (tail) rope_pair(x0, x1, cs);
  const int e = num::indexer_quant_scale_exp(lane_group_amax<kBlockPairs>(pair_amax(x0, x1)));
  p.cache[p.layout.data_offset(loc) + j] = fp4_code_pair(x0, x1, num::pow2_f32(e));
  if (j % kBlockPairs == 0) p.cache[p.layout.scale_offset(loc) + j / kBlockPairs] = num::ue8m0_from_exp(e);
}

}  // namespace v4attn::kernels::detail
