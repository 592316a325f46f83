// The window-K store's per-pair body (spec 3.2), shared by window_k_store_kernel (window_k.cu)
// and the fused Q chain (gemm/gemm_qchain.cu, whose spare CTAs write the window K of its rows).
// Pair j (0..255) of row t: dims 2j, 2j+1; see window_k.cu for the layout of the work.
#pragma once

#include "kernels/prepare_common.cuh"
#include "v4attn/kernels/prepare_kernels.h"

namespace v4attn::kernels::detail {

namespace window_k {
constexpr int kNope = kPrepHeadDim - num::kRopeDim;        // 448
constexpr int kPairs = kPrepHeadDim / 2;                   // 256
constexpr int kTailFirstPair = kNope / 2;                  // 224: warp 7 of the row
constexpr int kV41BlockPairs = num::kActQuantBlock / 2;    // 16 lanes per V41 block
constexpr int kV4BlockPairs = 64 / 2;                      // 32: one warp per V4 block
static_assert(kTailFirstPair % 32 == 0, "the RoPE / bf16 tail pairs are a whole warp (uniform branch)");

}  // namespace window_k

// kPdlWait: wait for the stream predecessor (dev::pdl_wait) after the metadata and constant loads,
// before the first load of the kv row, and trigger after the stores (the standalone kernel).
// Without it the caller guarantees the kv row is visible (the fused Q chain's arrival counter).
// Every lane of a warp must call it with pairs of one aligned 32-pair group (the tail branch and
// the shuffles are warp-uniform) and the same row.
template <bool kPdlWait>
__device__ __forceinline__ void window_k_store_pair(const WindowKStoreParams& p, int t, int j, int lane) {
  using namespace window_k;
  // Step metadata and constants only.
  const int32_t loc = p.swa_loc[t];
  const int32_t pos = p.pos[t];
  // Window slots start at 0 (swa_loc < 0: no write; the reference's norm has no other output on the
  // GPU side); a slot past the pool is skipped and counted, like the reference's `skipped`.
  const PagedRow verdict = paged_row_verdict(loc, 0, p.n_slots, pos, p.max_pos);
  if (verdict != PagedRow::kWrite) {
    if (verdict == PagedRow::kCounted && j == 0) dev::count_error(p.err_count);
    return;
  }
  const bool tail = j >= kTailFirstPair;
  const float2 w = ldg_f32x2(p.kv_norm + 2 * j);
  const float2 cs = tail ? ldg_f32x2(p.table + static_cast<int64_t>(pos) * num::kRopeDim + 2 * (j - kTailFirstPair))
                         : make_float2(0.0f, 0.0f);

  if constexpr (kPdlWait) dev::pdl_wait();  // the kv row is the QA GEMM's output

  const bf16_t* row = p.kv + static_cast<int64_t>(t) * p.kv_row_stride;
  float x0, x1;
  load_bf16x2(row + 2 * j, x0, x1);
  const float r = num::rmsnorm_rstd(warp_row_sum_squares<kPrepHeadDim>(row, lane), kPrepHeadDim, p.eps);
  rmsnorm_apply_pair(x0, x1, r, w);
  if (tail) rope_pair(x0, x1, cs);

  uint8_t* data = p.cache + p.layout.data_offset(loc);
  uint8_t* scales = p.cache + p.layout.scale_offset(loc);
  if (p.kind == CacheKind::kWindowV41) {
    const int e = num::act_quant_scale_exp(lane_group_amax<kV41BlockPairs>(pair_amax(x0, x1)));
    *reinterpret_cast<uint16_t*>(data + 2 * j) = act_quant_code_pair(x0, x1, e);
    if (j % kV41BlockPairs == 0) scales[j / kV41BlockPairs] = num::ue8m0_from_exp(e);
  } else if (!tail) {  // kWindowV4, dims 0..447: block j / 32 is this warp
    const int e = num::act_quant_scale_exp(lane_group_amax<kV4BlockPairs>(pair_amax(x0, x1)));
    *reinterpret_cast<uint16_t*>(data + 2 * j) = act_quant_code_pair(x0, x1, e);
    if (j % kV4BlockPairs == 0) scales[j / kV4BlockPairs] = num::ue8m0_from_exp(e);
  } else {  // kWindowV4, the roped bf16 tail (little-endian, even element first)
    *reinterpret_cast<uint32_t*>(data + kNope + 4 * (j - kTailFirstPair)) = pack_bf16x2(x0, x1);
    if (j == kTailFirstPair) scales[kNope / 64] = 0;  // the pad byte after the 7 scales
  }

  if constexpr (kPdlWait) dev::pdl_launch_dependents();  // after this thread's last store
}

}  // namespace v4attn::kernels::detail
